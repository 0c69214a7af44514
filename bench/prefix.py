"""Prefix caching (issue #22): what a hit saves, what caching does under load, and that another key never hits.

Starts ``kvfence serve`` itself with a tenants file of two tenants (alice, bob), one server at a time: with its
defaults (the prefix cache on, where it exists) and with ``--no-enable-prefix-caching``, in alternation (on, off,
then off, on, ...) for ``--rounds`` rounds, so that drift on a shared host hits both alike; on against off is
compared as ratios within the run. Where ``kvfence serve`` has no such flag (before the cache lands), the off
variant is skipped and the run says so. Streaming, greedy, EOS ignored; on each server:

- (a) hit and miss TTFT.
  System prompt: a fresh ~``--system-tokens`` (1,500) system prompt and a question from alice (miss), then the
  same system prompt with another question from alice (hit). Multi-turn: chats of ``--turns`` turns, turn k
  resending turns 1..k-1 (user messages of ~``--turn-tokens`` and the answers); each turn k >= 2 (hit) against
  the same messages with the first one's tag changed, so that no prefix is shared (miss).
- (b) load: a closed loop of ``--concurrency`` (16) clients, ``--requests`` requests, the tenants in turn; 80% of
  them start with one of ``--shared-prompts`` (3) system prompts of their tenant, 20% with a unique one. Output
  tok/s, TTFT p50 and p99; the same requests on every server.
- (c) cross key: alice's system prompt sent by bob, against a fresh one from bob and alice's first send (misses)
  and alice's repeat (the hit of (a)); judged by ``kvfence probe``'s timing rule. With kvfence it must look like
  a miss.

    .venv/bin/python bench/prefix.py            # 2 rounds: ~15 min with both variants on 2 cores
    .venv/bin/python bench/prefix.py --quick    # 1 round, fewer samples: a few minutes
    .venv/bin/python bench/prefix.py --quick --url http://127.0.0.1:8600   # a running server (vLLM: any keys)

Writes JSON (``--json``) with the CPU model and flags, and prints tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import serve as load  # noqa: E402  (bench/serve.py: the streaming client, percentiles)
from machine import cpu  # noqa: E402

from kvfence.tools.probe import ISOLATED, NO_CACHE, TimingRound, timing_prefix, timing_verdict  # noqa: E402
from kvfence.tools.soak import LocalServer  # noqa: E402

KEYS = {"alice": "sk-prefix-alice", "bob": "sk-prefix-bob"}
OFF_FLAG = "--no-enable-prefix-caching"
QUESTIONS = ("In one word, what is the text above about?", "Which word does the text above use most?",
             "What is the last word of the text above?", "Summarise the text above in five words.")
SHARED_FRACTION = 0.8


# -- the workload (pure) ----------------------------------------------------------------------------------


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def turn_text(tag: str, turn: int, words: int, rng: random.Random) -> str:
    """User message ``turn`` of the chat ``tag``: the tag first (so that the chat's first message is unique from
    its first words), then ``words`` filler words."""
    return timing_prefix(f"{tag}, turn {turn}", words, rng) + "\n\nWhat comes next?"


def retagged(messages: list[dict], tag: str, fresh: str) -> list[dict]:
    """``messages`` with the first one's ``tag`` replaced by ``fresh``: as long, sharing no prefix with them."""
    first = {**messages[0], "content": messages[0]["content"].replace(tag, fresh, 1)}
    return [first, *messages[1:]]


def load_jobs(n: int, shared: dict[str, list[str]], words: int, rng: random.Random) -> list[tuple[str, list[dict]]]:
    """``n`` requests ``(tenant, messages)``, the tenants in turn: four in five start with one of their tenant's
    ``shared`` system prompts (in turn), the fifth with a unique one; every question is unique."""
    tenants, jobs = list(shared), []
    for i in range(n):
        tenant = tenants[i % len(tenants)]
        own = shared[tenant]
        unique = (i // len(tenants)) % 5 == 4
        system = timing_prefix(f"unique {load.RUN_TAG}-{i}", words, rng) if unique else own[(i // 5) % len(own)]
        jobs.append((tenant, chat(system, f"Request {load.RUN_TAG}-{i}. {QUESTIONS[i % len(QUESTIONS)]}")))
    return jobs


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- one server ---------------------------------------------------------------------------------------------


class Bench:
    """The measurements on one running server; ``clients`` by tenant."""

    def __init__(self, url: str, args: argparse.Namespace, rng: random.Random) -> None:
        self.clients = {t: load.Client(url + "/v1", None, key) for t, key in KEYS.items()}
        self.args, self.rng = args, rng

    def fresh(self) -> str:
        return f"{self.rng.randrange(10**7, 10**8)}"

    def system(self, words: int) -> str:
        return timing_prefix(f"policy {self.fresh()}", words, self.rng)

    async def send(self, http: httpx.AsyncClient, tenant: str, messages: list[dict],
                   max_tokens: int | None = None) -> load.Result:
        return await self.clients[tenant].complete(http, "", max_tokens or self.args.max_tokens, messages)

    async def system_and_cross_key(self, http: httpx.AsyncClient, words: int) -> dict:
        """(a) system prompt miss and hit (alice), (c) bob on alice's prompt and on a fresh one, in an order that
        alternates by sample."""
        rows = []
        for i in range(self.args.samples):
            prompt = self.system(words)
            miss = await self.send(http, "alice", chat(prompt, QUESTIONS[0]))
            pair = [("cross", prompt), ("fresh", self.system(words))]
            got = {}
            for kind, system in pair if i % 2 == 0 else pair[::-1]:
                got[kind] = await self.send(http, "bob", chat(system, QUESTIONS[1]))
            hit = await self.send(http, "alice", chat(prompt, QUESTIONS[2]))
            rows.append({"prompt_tokens": miss.prompt_tokens, "miss_ttft": miss.ttft, "hit_ttft": hit.ttft,
                         "hit_cached_tokens": hit.cached_tokens, "cross_ttft": got["cross"].ttft,
                         "cross_cached_tokens": got["cross"].cached_tokens, "fresh_ttft": got["fresh"].ttft})
            print(f"    system prompt {i + 1}: {miss.prompt_tokens} tokens, alice miss {miss.ttft:.3f}s hit "
                  f"{hit.ttft:.3f}s; bob on alice's {got['cross'].ttft:.3f}s, fresh {got['fresh'].ttft:.3f}s",
                  file=sys.stderr, flush=True)
        return {"samples": rows}

    async def multi_turn(self, http: httpx.AsyncClient) -> list[dict]:
        """(a) chats of ``--turns`` turns; each turn from the second against its retagged copy."""
        rows = []
        for c in range(self.args.chats):
            tag, messages = f"chat {self.fresh()}", []
            for turn in range(1, self.args.turns + 1):
                messages.append({"role": "user", "content": turn_text(tag, turn, self.args.turn_words, self.rng)})
                control = retagged(messages, tag, f"chat {self.fresh()}")
                if turn == 1:
                    hit = await self.send(http, "alice", messages)
                else:  # the miss first in even turns, the hit first in odd ones
                    first = await self.send(http, "alice", control if turn % 2 == 0 else messages)
                    second = await self.send(http, "alice", messages if turn % 2 == 0 else control)
                    hit, miss = (second, first) if turn % 2 == 0 else (first, second)
                    rows.append({"chat": c + 1, "turn": turn, "prompt_tokens": hit.prompt_tokens,
                                 "hit_ttft": hit.ttft, "miss_ttft": miss.ttft, "hit_cached_tokens": hit.cached_tokens})
                    print(f"    chat {c + 1} turn {turn}: {hit.prompt_tokens} tokens, hit {hit.ttft:.3f}s, miss "
                          f"{miss.ttft:.3f}s", file=sys.stderr, flush=True)
                messages.append({"role": "assistant", "content": hit.text})
        return rows

    async def load(self, jobs: list[tuple[str, list[dict]]]) -> dict:
        """(b) ``jobs`` in a closed loop of ``--concurrency`` clients."""
        results, failures, todo = [], 0, iter(jobs)

        async def user(http: httpx.AsyncClient) -> None:
            nonlocal failures
            for tenant, messages in todo:
                try:
                    results.append(await self.send(http, tenant, messages, self.args.load_max_tokens))
                except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
                    failures += 1
                    print(f"    load request failed: {e}", file=sys.stderr)

        c = self.args.concurrency
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=c + 4)) as http:
            await asyncio.gather(*(user(http) for _ in range(c)))
        wall = time.perf_counter() - t0
        ttft = [r.ttft for r in results]
        cached = [r.cached_tokens for r in results if r.cached_tokens is not None]
        return {"requests": len(jobs), "failures": failures, "wall_s": wall,
                "output_tok_s": sum(r.tokens for r in results) / wall, "ttft_p50": load.pct(ttft, 0.5),
                "ttft_p99": load.pct(ttft, 0.99), "prompt_tokens": sum(r.prompt_tokens for r in results),
                "cached_tokens": sum(cached) if cached else None}

    async def run(self, words: int, jobs: list[tuple[str, list[dict]]]) -> dict:
        async with httpx.AsyncClient(timeout=3600) as http:
            await self.send(http, "bob", chat(self.system(words), QUESTIONS[0]))  # warm-up: first-request costs
            system = await self.system_and_cross_key(http, words)
            turns = await self.multi_turn(http)
        return {"system": system, "multi_turn": turns, "load": await self.load(jobs)}


def calibrate_words(client: load.Client, target: int) -> int:
    """Filler words for a system prompt that makes a chat of about ``target`` prompt tokens."""
    rng = random.Random(0)

    def tokens(words: int) -> int:
        body = {"model": client.model, "max_tokens": 1, "messages": chat(timing_prefix("policy 1", words, rng), "Hi")}
        r = httpx.post(client.url + "/chat/completions", json=body, headers=client.headers, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["prompt_tokens"]

    a, b = tokens(100), tokens(600)
    return max(1, round(100 + (target - a) * 500 / (b - a)))


def serve_has_flag(flag: str) -> bool:
    """Whether ``kvfence serve`` of this tree takes ``flag``."""
    done = subprocess.run([sys.executable, "-m", "kvfence.cli", "serve", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    return flag in done.stdout


# -- summary ------------------------------------------------------------------------------------------------


def summarise(runs: list[dict]) -> dict:
    """Per variant: medians over every sample of every round; the timing verdict of (c); on/off ratios of (b) per
    round, then their median."""
    out: dict[str, dict] = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        samples = [s for r in mine for s in r["system"]["samples"]]
        turns = [t for r in mine for t in r["multi_turn"]]
        loads = [r["load"] for r in mine]
        verdict = timing_verdict([TimingRound(s["miss_ttft"], s["cross_ttft"], s["fresh_ttft"], s["hit_ttft"],
                                              s["cross_cached_tokens"]) for s in samples],
                                 median([s["prompt_tokens"] for s in samples]))
        by_turn = {}
        for k in sorted({t["turn"] for t in turns}):
            rows = [t for t in turns if t["turn"] == k]
            by_turn[k] = {"prompt_tokens": median([t["prompt_tokens"] for t in rows]),
                          "hit_ttft": median([t["hit_ttft"] for t in rows]),
                          "miss_ttft": median([t["miss_ttft"] for t in rows])}
        out[label] = {
            "system_prompt_tokens": median([s["prompt_tokens"] for s in samples]),
            "system_miss_ttft": median([s["miss_ttft"] for s in samples]),
            "system_hit_ttft": median([s["hit_ttft"] for s in samples]),
            "cross_key_ttft": median([s["cross_ttft"] for s in samples]),
            "cross_key_fresh_ttft": median([s["fresh_ttft"] for s in samples]),
            "cross_key_verdict": verdict.verdict, "cross_key_why": verdict.why,
            "multi_turn": by_turn,
            "load_output_tok_s": median([lo["output_tok_s"] for lo in loads]),
            "load_ttft_p50": median([lo["ttft_p50"] for lo in loads]),
            "load_ttft_p99": median([lo["ttft_p99"] for lo in loads]),
            "load_failures": sum(lo["failures"] for lo in loads),
            "load_cached_tokens": [lo["cached_tokens"] for lo in loads]}
    if "cache on" in out and "cache off" in out:
        rounds = sorted({r["round"] for r in runs})

        def paired(field: str) -> float | None:
            pairs = [(next(r for r in runs if r["round"] == k and r["label"] == "cache on")["load"][field],
                      next(r for r in runs if r["round"] == k and r["label"] == "cache off")["load"][field])
                     for k in rounds]
            return median([a / b for a, b in pairs if b])

        out["on_over_off"] = {f: paired(f) for f in ("output_tok_s", "ttft_p50", "ttft_p99")}
    return out


def ms(v: float | None) -> str:
    return f"{v * 1e3:.0f} ms" if v is not None else "-"


def print_tables(report: dict) -> None:
    c, s, w = report["cpu"], report["summary"], report["workload"]
    print(f"\n{c['model']}, {c['cores']} cores; flags {' '.join(c['flags'])}")
    for note in report["notes"]:
        print(f"note: {note}")
    variants = [k for k in s if k != "on_over_off"]
    print(f"\n(a) TTFT, hit against miss (medians; system prompt ~{w['system_tokens']} tokens)")
    print(f"{'server':<12}{'case':<34}{'tokens':>8}{'miss':>10}{'hit':>10}{'hit/miss':>10}")
    for v in variants:
        row = s[v]
        print(f"{v:<12}{'system prompt':<34}{row['system_prompt_tokens'] or 0:>8.0f}{ms(row['system_miss_ttft']):>10}"
              f"{ms(row['system_hit_ttft']):>10}{ratio(row['system_hit_ttft'], row['system_miss_ttft']) or 0:>10.2f}")
        for k, t in row["multi_turn"].items():
            print(f"{v:<12}{f'multi-turn, turn {k}':<34}{t['prompt_tokens'] or 0:>8.0f}{ms(t['miss_ttft']):>10}"
                  f"{ms(t['hit_ttft']):>10}{ratio(t['hit_ttft'], t['miss_ttft']) or 0:>10.2f}")
    print(f"\n(b) load: c={w['concurrency']}, {w['requests']} requests, {w['load_max_tokens']} output tokens, "
          f"{SHARED_FRACTION:.0%} on {w['shared_prompts']} shared system prompts per tenant (medians of rounds)")
    print(f"{'server':<12}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'fail':>6}  cached tokens per round")
    for v in variants:
        row = s[v]
        print(f"{v:<12}{row['load_output_tok_s']:>11.1f}{ms(row['load_ttft_p50']):>10}{ms(row['load_ttft_p99']):>10}"
              f"{row['load_failures']:>6}  {row['load_cached_tokens']}")
    if "on_over_off" in s:
        r = s["on_over_off"]
        print("on / off (paired by round, median): " + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if v))
    print("\n(c) alice's system prompt sent by bob (medians)")
    print(f"{'server':<12}{'bob fresh':>10}{'bob on alice':>14}{'alice repeat':>14}  verdict")
    for v in variants:
        row = s[v]
        print(f"{v:<12}{ms(row['cross_key_fresh_ttft']):>10}{ms(row['cross_key_ttft']):>14}"
              f"{ms(row['system_hit_ttft']):>14}  {row['cross_key_verdict']}")
        if row["cross_key_verdict"] not in (ISOLATED, NO_CACHE):
            print(f"{'':<12}NOT A MISS: {row['cross_key_why']}")


# -- main ---------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, 3 samples, 1 chat of 3 turns, 32 load requests")
    ap.add_argument("--rounds", type=int, default=2, help="server starts per variant, alternating")
    ap.add_argument("--samples", type=int, default=4, help="system prompts per server for (a) and (c)")
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--chats", type=int, default=2, help="multi-turn chats per server")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=300, help="about the tokens of each user turn")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens of (a) and (c), and of each turn")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="load requests per server")
    ap.add_argument("--load-max-tokens", type=int, default=64)
    ap.add_argument("--shared-prompts", type=int, default=3, help="shared system prompts per tenant")
    ap.add_argument("--server-args", default="", help="extra 'kvfence serve' arguments, for every variant")
    ap.add_argument("--url", help="measure this running OpenAI-compatible server (http://HOST:PORT, without /v1) "
                                  "instead of starting kvfence")
    ap.add_argument("--keys", help="with --url: alice's and bob's API keys, comma-separated (two tenants)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench/results/prefix.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.samples, args.chats, args.turns, args.requests = 1, 3, 1, 3, 32
    args.turn_words = max(1, args.turn_tokens - 8)  # the tag and the question; one token per filler word
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the server started here stops too

    notes, variants = [], [("cache on", [])]
    if args.url:
        KEYS.update(zip(KEYS, args.keys.split(","), strict=True) if args.keys else {})
        notes.append(f"a running server at {args.url}: nothing started, no cache-off variant")
    elif serve_has_flag(OFF_FLAG):
        variants.append(("cache off", [OFF_FLAG]))
    else:
        variants = [("default", [])]
        notes.append(f"'kvfence serve' has no {OFF_FLAG} (no prefix cache in this tree): only its default runs, "
                     "and hits should time like misses")
        print(f"note: {notes[-1]}", file=sys.stderr, flush=True)
    rng = random.Random(args.seed)
    tenants = tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="kvfence-prefix-")
    tenants.write("".join(f'[tenants.{t}]\napi_keys = ["{k}"]\n\n' for t, k in KEYS.items()))
    tenants.flush()
    words, jobs, runs = None, None, []

    def measure(url: str, label: str, rnd: int, extra: list[str]) -> None:
        nonlocal words, jobs
        bench = Bench(url, args, rng)
        if words is None:
            words = calibrate_words(bench.clients["alice"], args.system_tokens)
        if jobs is None or args.url:  # the same requests on every server started here; new ones on a running one
            shared = {t: [bench.system(words) for _ in range(args.shared_prompts)] for t in KEYS}
            jobs = load_jobs(args.requests, shared, words, rng)
        result = asyncio.run(bench.run(words, jobs))
        lo = result["load"]
        print(f"  load: {lo['output_tok_s']:.1f} tok/s, TTFT p50 {lo['ttft_p50']:.2f}s p99 {lo['ttft_p99']:.2f}s, "
              f"{lo['failures']} failed", file=sys.stderr, flush=True)
        runs.append({"label": label, "round": rnd + 1, "server_args": extra, **result})

    for rnd in range(args.rounds):
        if args.url:
            print(f"round {rnd + 1}/{args.rounds}: {args.url}", file=sys.stderr, flush=True)
            measure(args.url.rstrip("/"), "server", rnd, [])
            continue
        for label, extra in variants if rnd % 2 == 0 else variants[::-1]:
            print(f"round {rnd + 1}/{args.rounds}: starting kvfence ({label})...", file=sys.stderr, flush=True)
            server = LocalServer([*extra, "--tenants", tenants.name, *args.server_args.split()], cwd=ROOT)
            try:
                server.wait_ready(600)
                measure(server.url, label, rnd, extra)
            finally:
                server.stop()
    report = {"cpu": cpu(), "notes": notes, "workload": {k: getattr(args, k) for k in (
        "rounds", "samples", "system_tokens", "chats", "turns", "turn_tokens", "max_tokens", "concurrency", "requests",
        "load_max_tokens", "shared_prompts", "server_args", "seed")}, "system_words": words,
              "summary": summarise(runs), "runs": runs}
    print_tables(report)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
