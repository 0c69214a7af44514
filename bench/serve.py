"""Load generator for any OpenAI-compatible server: output tok/s, req/s, TTFT and TPOT per concurrency.

The workload (the one issue #7 measured llama.cpp's server with): closed loop (each of ``concurrency``
clients sends its next request as soon as its last one ends), streaming chat completions, temperature 0,
``--max-tokens`` (128) output tokens with EOS ignored, every prompt unique and ``--prompt-tokens`` (204)
long after the chat template (calibrated against the server's own ``usage.prompt_tokens``), N = max(4, 2 x
concurrency) requests per run, ``--repeats`` (3) runs per level, medians reported. Then one
``--long-prompt`` (2,000-token) request with one output token: prefill tok/s = prompt tokens / TTFT.

Against one URL:
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000/v1

Colocated against disaggregated kvfence, both started here and measured in alternation (A, B, A, B per
level and repeat, so drift on a shared machine hits both alike):
    .venv/bin/python bench/serve.py --compare [--server-args "--threads 1"]

Writes JSON (``--json``), a PNG plot of throughput and p99 TTFT against concurrency next to it, and
prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FILLER = ("The quick brown fox jumps over the lazy dog while the river runs past old stone walls and green "
          "fields under a pale sky. ").split()


@dataclass
class Result:
    ttft: float  # seconds to the first content token
    tpot: float  # mean seconds per output token after the first
    tokens: int  # completion tokens (from usage)
    prompt_tokens: int
    text: str = ""  # the content streamed
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it


@dataclass
class Run:
    """One closed-loop run of ``requests`` requests at ``concurrency``."""

    label: str
    concurrency: int
    requests: int
    failures: int
    wall_s: float
    output_tok_s: float
    req_s: float
    ttft_mean: float
    ttft_p99: float
    tpot_mean: float


class Client:
    """Streams chat completions from one OpenAI-compatible base URL."""

    def __init__(self, url: str, model: str | None, key: str) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"}
        self.model = model or httpx.get(self.url + "/models", headers=self.headers, timeout=30).json()["data"][0]["id"]

    async def complete(self, http: httpx.AsyncClient, prompt: str, max_tokens: int,
                       messages: list[dict] | None = None) -> Result:
        """Stream one greedy chat: ``prompt`` as the only user message, or the chat ``messages`` when given."""
        body = {"model": self.model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True},
                "messages": messages or [{"role": "user", "content": prompt}]}
        t0 = time.perf_counter()
        first, tokens, prompt_tokens, text, cached = None, 0, 0, [], None
        async with http.stream("POST", self.url + "/chat/completions", json=body, headers=self.headers) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens, prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
                    cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                choices = chunk.get("choices") or [{}]
                content = (choices[0].get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
        end = time.perf_counter()
        first = first or end
        return Result(first - t0, (end - first) / max(tokens - 1, 1), tokens, prompt_tokens, "".join(text), cached)

    def prompt_tokens(self, prompt: str) -> int:
        body = {"model": self.model, "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]}
        r = httpx.post(self.url + "/chat/completions", json=body, headers=self.headers, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["prompt_tokens"]


RUN_TAG = random.randrange(1000, 10000)  # one per invocation: no prompt repeats one of an earlier run


def make_prompt(i: int, words: int) -> str:
    """Prompt number ``i``: unique from its third word on (a prefix cache shares only the template), in this run
    and against earlier runs on the same server (whose prompt cache would otherwise answer), ``words`` long."""
    return f"Request {RUN_TAG}-{i}. Summarise this text: " + " ".join(FILLER[j % len(FILLER)] for j in range(words))


def calibrate(client: Client, target: int) -> int:
    """Filler words that make a prompt ``target`` tokens long after the server's chat template."""
    a, b = client.prompt_tokens(make_prompt(0, 20)), client.prompt_tokens(make_prompt(0, 220))
    per_word = (b - a) / 200
    words = max(0, round(20 + (target - a) / per_word))
    for _ in range(4):  # the fit is linear up to a token or two; settle on the server's own count
        got = client.prompt_tokens(make_prompt(0, words))
        if got == target:
            break
        words = max(0, words + (1 if got < target else -1))
    return words


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


async def closed_loop(client: Client, label: str, concurrency: int, requests: int, words: int, max_tokens: int,
                      first_id: int) -> Run:
    results: list[Result] = []
    failures = 0
    todo = iter(range(first_id, first_id + requests))

    async def user(http: httpx.AsyncClient) -> None:
        nonlocal failures
        for i in todo:
            try:
                try:
                    results.append(await client.complete(http, make_prompt(i, words), max_tokens))
                except httpx.RemoteProtocolError:  # a kept-alive connection the server had closed (llama-server
                    results.append(await client.complete(http, make_prompt(i, words), max_tokens))  # does): again
            except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
                failures += 1
                print(f"    request {i} failed: {e}", file=sys.stderr)

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        await asyncio.gather(*(user(http) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ttft = [r.ttft for r in results]
    return Run(label, concurrency, requests, failures, wall, sum(r.tokens for r in results) / wall,
               len(results) / wall, statistics.fmean(ttft) if ttft else float("nan"), pct(ttft, 0.99),
               statistics.fmean(r.tpot for r in results) if results else float("nan"))


def median_run(runs: list[Run]) -> dict:
    """Per-field medians over repeats (failures summed)."""
    out = asdict(runs[0])
    for field in ("wall_s", "output_tok_s", "req_s", "ttft_mean", "ttft_p99", "tpot_mean"):
        out[field] = statistics.median(getattr(r, field) for r in runs)
    out["failures"] = sum(r.failures for r in runs)
    out["repeats"] = len(runs)
    return out


def long_prompt(client: Client, tokens: int, repeat: int = 0, words: int | None = None) -> dict:
    """One prompt of ``tokens`` tokens (``words`` filler words where already calibrated), one output token: TTFT
    and prefill tok/s. Each ``repeat`` sends a prompt of its own, which no prefix cache can answer."""
    words = calibrate(client, tokens) if words is None else words
    result = asyncio.run(_single(client, make_prompt(10**6 + repeat, words)))
    return {"prompt_tokens": result.prompt_tokens, "ttft_s": result.ttft,
            "prefill_tok_s": result.prompt_tokens / result.ttft}


async def _single(client: Client, prompt: str) -> Result:
    async with httpx.AsyncClient(timeout=3600) as http:
        return await client.complete(http, prompt, 1)


def print_table(levels: list[dict]) -> None:
    print(f"\n{'server':<15}{'conc':>5}{'reqs':>6}{'out tok/s':>11}{'req/s':>7}{'TTFT mean':>11}{'TTFT p99':>10}"
          f"{'TPOT mean':>11}{'fail':>6}")
    for lv in levels:
        print(f"{lv['label']:<15}{lv['concurrency']:>5}{lv['requests']:>6}{lv['output_tok_s']:>11.1f}"
              f"{lv['req_s']:>7.2f}{lv['ttft_mean'] * 1e3:>9.0f}ms{lv['ttft_p99'] * 1e3:>8.0f}ms"
              f"{lv['tpot_mean'] * 1e3:>9.1f}ms{lv['failures']:>6}")


def plot(levels: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(lv["label"] for lv in levels):
        rows = [lv for lv in levels if lv["label"] == label]
        conc = [lv["concurrency"] for lv in rows]
        tput.plot(conc, [lv["output_tok_s"] for lv in rows], marker="o", label=label)
        ttft.plot(conc, [lv["ttft_p99"] for lv in rows], marker="o", label=label)
    for ax, title in ((tput, "output tokens/s"), (ttft, "p99 TTFT (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", help="model id (default: the server's first)")
    ap.add_argument("--key", default="none")
    ap.add_argument("--compare", action="store_true", help="start colocated and disaggregated kvfence and compare")
    ap.add_argument("--server-args", default="", help="extra 'kvfence serve' arguments for --compare")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests", type=int, help="requests per run (default: max(4, 2 x concurrency))")
    ap.add_argument("--repeats", type=int, default=3, help="runs per level; medians are reported")
    ap.add_argument("--prompt-tokens", type=int, default=204)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=2000, help="prefill check prompt tokens (0: skip)")
    ap.add_argument("--json", default="bench/results/serve.json")
    args = ap.parse_args()
    if not args.url and not args.compare:
        ap.error("give --url or --compare")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers started here stop too

    servers = []
    try:
        if args.compare:
            from kvfence.tools.soak import LocalServer

            print("starting colocated and disaggregated kvfence...", file=sys.stderr, flush=True)
            extra = args.server_args.split()
            servers = [("colocated", LocalServer(["--mode", "colocated", *extra], cwd=ROOT)),
                       ("disaggregated", LocalServer(extra, cwd=ROOT))]
            for _, s in servers:
                s.wait_ready(600)
            clients = [(label, Client(s.url + "/v1", args.model, args.key)) for label, s in servers]
        else:
            clients = [("server", Client(args.url, args.model, args.key))]
        words = calibrate(clients[0][1], args.prompt_tokens)
        print(f"prompts: {words} filler words = {args.prompt_tokens} tokens after the chat template",
              file=sys.stderr, flush=True)
        levels, next_id = [], 1
        for c in args.concurrency:
            n = args.requests or max(4, 2 * c)
            runs: dict[str, list[Run]] = {label: [] for label, _ in clients}
            for rep in range(args.repeats):
                for label, client in clients:
                    run = asyncio.run(closed_loop(client, label, c, n, words, args.max_tokens, next_id))
                    next_id += n
                    runs[label].append(run)
                    print(f"  {label} c={c} run {rep + 1}/{args.repeats}: {run.output_tok_s:.1f} tok/s, "
                          f"TTFT p99 {run.ttft_p99:.2f}s, {run.failures} failed", file=sys.stderr, flush=True)
            levels += [median_run(r) for r in runs.values()]
        prefill = {}
        if args.long_prompt:
            for label, client in clients:
                prefill[label] = long_prompt(client, args.long_prompt)
                print(f"  {label}: {args.long_prompt}-token prompt, TTFT {prefill[label]['ttft_s']:.2f}s",
                      file=sys.stderr, flush=True)
    finally:
        for _, s in servers:
            s.stop()

    print_table(levels)
    for label, p in prefill.items():
        print(f"{label}: {p['prompt_tokens']}-token prompt: TTFT {p['ttft_s']:.2f} s, {p['prefill_tok_s']:.0f} "
              "prefill tok/s")
    report = {"workload": {k: getattr(args, k) for k in ("prompt_tokens", "max_tokens", "repeats", "concurrency")},
              "levels": levels, "long_prompt": prefill}
    if args.compare:
        ratio = {c: next(lv for lv in levels if lv["label"] == "disaggregated" and lv["concurrency"] == c)
                 ["output_tok_s"] / next(lv for lv in levels if lv["label"] == "colocated" and lv["concurrency"] == c)
                 ["output_tok_s"] for c in args.concurrency}
        report["disaggregated_over_colocated_throughput"] = ratio
        print("disaggregated / colocated output tok/s: " + ", ".join(f"c={c}: {r:.2f}" for c, r in ratio.items()))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    plot(levels, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
