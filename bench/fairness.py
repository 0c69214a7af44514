"""Capacity isolation under overload: a flooding tenant against a victim, weighted shares, fair against FCFS.

Starts two ``kvfence serve`` (SmolLM2 by default; ``--tiny`` for a quick run on a tiny random model) with one
tenants file, one with ``--scheduling fair`` and one with ``--scheduling fcfs``, and runs:

(a) **Flood**, on each server in turn (fair, fcfs, fair, fcfs... for ``--rounds``): tenant bob keeps
    ``--flood-streams`` (32) streams of ``--flood-prompt`` (940)-token prompts with ``--flood-output`` (200)
    output tokens (EOS ignored) going for ``--seconds`` (60), while tenant alice sends short chats (a 20-token
    question, 32 output tokens) one at a time. Per tenant: median and p90 time to first token (bob's over the
    requests sent after ``--warmup`` seconds; those still waiting at the end count with the time they had waited,
    a lower bound), requests completed, 429s and 503s, output tokens/s.
(b) **Weights**, on the fair server: tenants w1, w2 and w4 with weights 1, 1 and 2 each keep ``--weight-streams``
    (16) streams of the flood's requests going for ``--seconds``. Per tenant: output tokens/s after the warm-up,
    and its share of the total over its weight share (1.00 is exact).
(c) **Fair against FCFS**: total output tokens/s of (a)'s load on each server, rounds interleaved so that drift on
    a shared machine hits both alike.

Targets (issue #19): (a) alice's median TTFT <= 0.25 x bob's and <= 3 s, no 503; (b) every ratio within 15% of
1; (c) fair >= 0.95 x FCFS. Writes ``--json`` (bench/results/fairness.json) and prints tables.

    .venv/bin/python bench/fairness.py            # SmolLM2, about 8 minutes
    .venv/bin/python bench/fairness.py --tiny --seconds 20 --warmup 5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu  # noqa: E402
from bench.serve import Client, calibrate, make_prompt, pct  # noqa: E402

ADMIN_KEY = "sk-bench-admin"
WEIGHTS = {"w1": 1, "w2": 1, "w4": 2}
TENANTS = ["alice", "bob", *WEIGHTS]


@dataclass
class Record:
    """One streamed request as its client saw it."""

    tenant: str
    sent: float
    first: float | None = None  # first chunk: sent with the first token
    end: float | None = None  # the stream ended ([DONE]), or the error came back
    status: int = 200
    token_times: list[float] = field(default_factory=list)  # one per content chunk

    @property
    def done(self) -> bool:
        return self.end is not None and self.status == 200


class Load:
    """Streams chat completions to one server and records each."""

    def __init__(self, url: str, model: str, http: httpx.AsyncClient) -> None:
        self.url, self.model, self.http = url, model, http
        self.records: list[Record] = []
        self.ids = itertools.count(1)

    async def stream(self, tenant: str, prompt: str, max_tokens: int) -> Record:
        rec = Record(tenant, time.monotonic())
        self.records.append(rec)
        body = {"model": self.model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "messages": [{"role": "user", "content": prompt}]}
        headers = {"Authorization": f"Bearer sk-{tenant}"}
        async with self.http.stream("POST", self.url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                rec.status, rec.end = r.status_code, time.monotonic()
                await r.aread()
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                rec.first = rec.first or now
                if line == "data: [DONE]":
                    rec.end = now
                elif '"content"' in line and '"error"' not in line:
                    rec.token_times.append(now)
                elif '"error"' in line:
                    rec.status = json.loads(line[6:]).get("error", {}).get("code") or 500
        return rec

    async def closed_loop(self, tenant: str, words: int, max_tokens: int) -> None:
        """Send the next request as soon as the last one ends, until cancelled."""
        while True:
            rec = await self.stream(tenant, make_prompt(next(self.ids), words), max_tokens)
            if rec.status != 200:
                await asyncio.sleep(0.5)  # a refusal says to retry later

    async def chats(self, tenant: str, max_tokens: int) -> None:
        """Short chats, one at a time, until cancelled."""
        while True:
            await self.stream(tenant, f"Question {next(self.ids)}: what is the capital of France?", max_tokens)
            await asyncio.sleep(0.2)


async def warm_up(url: str, model: str, words: int) -> None:
    """A few requests of each shape, so that no measured round pays for a cold server (first forward passes,
    kernel caches)."""
    async with httpx.AsyncClient(timeout=3600) as http:
        load = Load(url, model, http)
        for n in (1, 4):
            await asyncio.gather(*(load.stream("alice", make_prompt(10**6 + i, words), 16) for i in range(n)))
        await load.stream("alice", "Say hello.", 4)


async def run_for(seconds: float, jobs) -> None:
    """Run the coroutines for ``seconds``, then cancel them (their clients leave, queued or streaming)."""
    tasks = [asyncio.create_task(j) for j in jobs]
    await asyncio.sleep(seconds)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def wait_idle(url: str, timeout: float = 120) -> None:
    """Until the server holds no request (so that one phase's leftovers do not slow the next); then the router's
    room accounting must be back at zero."""
    async with httpx.AsyncClient(timeout=10) as http:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = (await http.get(url + "/health", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).json()
            if not health.get("in_flight") and not health.get("queued"):
                held = {w: (i["backlog_tokens"], i["reserved_pages"]) for w, i in health["workers"].items()
                        if i["backlog_tokens"] or i["reserved_pages"]}
                assert not held, f"room still counted as taken when idle: {held}"
                return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{url} still busy after {timeout}s")


def tenant_stats(records: list[Record], tenant: str, t0: float, t1: float, warmup: float) -> dict:
    mine = [r for r in records if r.tenant == tenant]
    measured = [r for r in mine if r.sent >= t0 + warmup and r.status == 200]
    ttft = [(r.first if r.first is not None else t1) - r.sent for r in measured]
    tokens = sum(1 for r in mine for t in r.token_times if t0 + warmup <= t <= t1)
    return {"ttft_median_s": statistics.median(ttft) if ttft else None, "ttft_p90_s": pct(ttft, 0.9) if ttft else None,
            "ttft_samples": len(ttft), "still_waiting_at_end": sum(1 for r in measured if r.first is None),
            "completed": sum(1 for r in mine if r.done), "status_429": sum(1 for r in mine if r.status == 429),
            "status_503": sum(1 for r in mine if r.status == 503),
            "other_errors": sum(1 for r in mine if r.status not in (200, 429, 503)),
            "output_tok_s": tokens / (t1 - t0 - warmup)}


async def flood(url: str, model: str, args, words: int) -> dict:
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=None)) as http:
        load = Load(url, model, http)
        t0 = time.monotonic()
        jobs = [load.closed_loop("bob", words, args.flood_output) for _ in range(args.flood_streams)]
        await run_for(args.seconds, [*jobs, load.chats("alice", 32)])
        t1 = time.monotonic()
    await wait_idle(url)
    out = {t: tenant_stats(load.records, t, t0, t1, args.warmup) for t in ("alice", "bob")}
    out["total_output_tok_s"] = sum(out[t]["output_tok_s"] for t in ("alice", "bob"))
    return out


async def weights(url: str, model: str, args, words: int) -> dict:
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=None)) as http:
        load = Load(url, model, http)
        t0 = time.monotonic()
        jobs = [load.closed_loop(t, words, args.flood_output) for t in WEIGHTS for _ in range(args.weight_streams)]
        await run_for(args.seconds, jobs)
        t1 = time.monotonic()
    await wait_idle(url)
    stats = {t: tenant_stats(load.records, t, t0, t1, args.warmup) for t in WEIGHTS}
    total = sum(s["output_tok_s"] for s in stats.values())
    for t, s in stats.items():
        s["weight"] = WEIGHTS[t]
        s["share_over_weight_share"] = (s["output_tok_s"] / total) / (WEIGHTS[t] / sum(WEIGHTS.values()))
    return stats


def median_of(rounds: list[dict], tenant: str) -> float:
    """The median over rounds of ``tenant``'s median TTFT (rounds without one left out; NaN if none has)."""
    values = [r[tenant]["ttft_median_s"] for r in rounds if r[tenant]["ttft_median_s"] is not None]
    return statistics.median(values) if values else float("nan")


def tenants_file() -> Path:
    lines = [f'[tenants.{t}]\napi_keys = ["sk-{t}"]\n' + (f"weight = {WEIGHTS[t]}\n" if t in WEIGHTS else "")
             for t in TENANTS]
    path = Path(tempfile.mkstemp(prefix="kvfence-fairness-", suffix=".toml")[1])
    path.write_text("\n".join(lines) + f'\n[admin]\napi_keys = ["{ADMIN_KEY}"]\n')
    return path


def server_args(args) -> list[str]:
    if not args.tiny:
        return args.server_args.split()
    from tests.tiny_models import tiny_model_dir

    return ["--model", str(tiny_model_dir("llama")), "--max-context", "2048", *args.server_args.split()]


def print_flood(label: str, result: dict) -> None:
    print(f"\n(a) flood, {label}")
    print(f"{'tenant':<8}{'TTFT med':>10}{'TTFT p90':>10}{'samples':>9}{'waiting':>9}{'done':>6}{'429':>5}{'503':>5}"
          f"{'other':>7}{'tok/s':>8}")
    for t in ("alice", "bob"):
        s = result[t]
        med, p90 = (f"{s[k]:.2f}s" if s[k] is not None else "-" for k in ("ttft_median_s", "ttft_p90_s"))
        print(f"{t:<8}{med:>10}{p90:>10}{s['ttft_samples']:>9}{s['still_waiting_at_end']:>9}{s['completed']:>6}"
              f"{s['status_429']:>5}{s['status_503']:>5}{s['other_errors']:>7}{s['output_tok_s']:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama (2,048-token context) for a quick run")
    ap.add_argument("--server-args", default="", help="more 'kvfence serve' arguments, for both servers")
    ap.add_argument("--seconds", type=float, default=60, help="length of each flood round and of the weights run")
    ap.add_argument("--warmup", type=float, default=15, help="seconds of each run left out of the figures")
    ap.add_argument("--rounds", type=int, default=2, help="flood rounds per server, interleaved")
    ap.add_argument("--flood-streams", type=int, default=32)
    ap.add_argument("--flood-prompt", type=int, default=940, help="prompt tokens (after the chat template)")
    ap.add_argument("--flood-output", type=int, default=200)
    ap.add_argument("--weight-streams", type=int, default=16, help="streams of each weighted tenant")
    ap.add_argument("--skip-weights", action="store_true")
    ap.add_argument("--json", default="bench/results/fairness.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers started here stop too
    from kvfence.tools.soak import LocalServer

    tenants = tenants_file()
    load_start = os.getloadavg()
    servers: dict[str, LocalServer] = {}
    try:
        for scheduling in ("fair", "fcfs"):
            servers[scheduling] = LocalServer([*server_args(args), "--tenants", str(tenants),
                                               "--scheduling", scheduling], cwd=ROOT)
        for s in servers.values():
            s.wait_ready(600)
        url = servers["fair"].url
        client = Client(url + "/v1", None, "sk-alice")
        words = calibrate(client, args.flood_prompt)
        print(f"{args.flood_prompt}-token prompts: {words} filler words", file=sys.stderr, flush=True)
        for server in servers.values():
            asyncio.run(warm_up(server.url, client.model, words))
        rounds: dict[str, list[dict]] = {"fair": [], "fcfs": []}
        for i in range(args.rounds):
            for scheduling, server in servers.items():
                print(f"flood round {i + 1}/{args.rounds}, {scheduling}...", file=sys.stderr, flush=True)
                result = asyncio.run(flood(server.url, client.model, args, words))
                rounds[scheduling].append(result)
                print_flood(f"{scheduling}, round {i + 1}", result)
        weighted = None
        if not args.skip_weights:
            print("weights 1:1:2, fair...", file=sys.stderr, flush=True)
            weighted = asyncio.run(weights(url, client.model, args, words))
    finally:
        for s in servers.values():
            s.stop()
        tenants.unlink()

    report = {"cpu": cpu(), "load_average": {"start": load_start, "end": os.getloadavg()}, "args": vars(args),
              "flood": rounds, "weights": weighted}
    if weighted:
        print("\n(b) weights 1:1:2, fair")
        print(f"{'tenant':<8}{'weight':>7}{'tok/s':>8}{'share/weight share':>20}{'done':>6}")
        for t, s in weighted.items():
            print(f"{t:<8}{s['weight']:>7}{s['output_tok_s']:>8.1f}{s['share_over_weight_share']:>20.2f}"
                  f"{s['completed']:>6}")
    totals = {k: statistics.median(r["total_output_tok_s"] for r in v) for k, v in rounds.items()}
    victim = {k: median_of(v, "alice") for k, v in rounds.items()}
    flooder = {k: median_of(v, "bob") for k, v in rounds.items()}
    report["summary"] = {"total_output_tok_s": totals, "fair_over_fcfs_throughput": totals["fair"] / totals["fcfs"],
                         "alice_median_ttft_s": victim, "bob_median_ttft_s": flooder,
                         "alice_over_bob_ttft": {k: victim[k] / flooder[k] for k in victim}}
    print("\n(c) fair against FCFS (medians over rounds)")
    print(f"{'':<6}{'total tok/s':>12}{'alice TTFT':>12}{'bob TTFT':>10}{'alice/bob':>11}")
    for k in ("fair", "fcfs"):
        print(f"{k:<6}{totals[k]:>12.1f}{victim[k]:>11.2f}s{flooder[k]:>9.2f}s{victim[k] / flooder[k]:>11.2f}")
    print(f"fair / fcfs total throughput: {totals['fair'] / totals['fcfs']:.3f}")
    print(f"CPU: {report['cpu']['model']} ({report['cpu']['cores']} cores; {' '.join(report['cpu']['flags'])}); load "
          f"average {load_start[0]:.1f} at the start, {report['load_average']['end'][0]:.1f} at the end")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=lambda o: asdict(o)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
