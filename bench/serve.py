"""Load generator for any OpenAI-compatible server: TTFT, TPOT, p50/p99 and output tokens/s per concurrency.

Against one URL:
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000/v1 --model smollm2-135m

Colocated against disaggregated kvfence in one run (both started here, measured interleaved per level):
    .venv/bin/python bench/serve.py --compare [--concurrency 1 4 16 32] [--requests-per-level 32]

Writes JSON (``--json``) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOPICS = ["the ocean", "a busy city", "mountains", "a library", "the night sky", "a small garden", "trains", "rain"]


@dataclass
class Result:
    ttft: float
    tpot: float
    tokens: int
    latency: float


@dataclass
class Level:
    label: str
    concurrency: int
    requests: int
    output_tok_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    errors: int


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, key: str, i: int, max_tokens: int) -> Result:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}. ({i})"}]}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return Result(first - t0, (end - first) / max(tokens - 1, 1), tokens, end - t0)


async def run_level(url: str, model: str, key: str, label: str, concurrency: int, requests: int,
                    max_tokens: int) -> Level:
    sem = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    errors = 0

    async def worker(i: int, client: httpx.AsyncClient) -> None:
        nonlocal errors
        async with sem:
            try:
                results.append(await one_request(client, url, model, key, i, max_tokens))
            except (httpx.HTTPError, json.JSONDecodeError):
                errors += 1

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(i, client) for i in range(requests)))
    wall = time.perf_counter() - t0
    ttft, tpot = [r.ttft for r in results], [r.tpot for r in results]
    return Level(label, concurrency, requests, sum(r.tokens for r in results) / wall, pct(ttft, 0.5), pct(ttft, 0.99),
                 pct(tpot, 0.5), pct(tpot, 0.99), errors)


def print_table(levels: list[Level]) -> None:
    print(f"\n{'server':<15}{'conc':>5}{'reqs':>6}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'TPOT p50':>10}{'TPOT p99':>10}{'errors':>8}")
    for lv in levels:
        print(f"{lv.label:<15}{lv.concurrency:>5}{lv.requests:>6}{lv.output_tok_s:>11.1f}{lv.ttft_p50 * 1e3:>8.0f}ms"
              f"{lv.ttft_p99 * 1e3:>8.0f}ms{lv.tpot_p50 * 1e3:>8.1f}ms{lv.tpot_p99 * 1e3:>8.1f}ms{lv.errors:>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--key", default="none")
    ap.add_argument("--compare", action="store_true", help="start colocated and disaggregated kvfence and compare")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests-per-level", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-args", default="", help="extra 'kvfence serve' arguments for --compare")
    ap.add_argument("--json", default="bench/results/serve.json")
    args = ap.parse_args()
    if not args.url and not args.compare:
        ap.error("give --url or --compare")

    levels: list[Level] = []
    servers = []
    try:
        if args.compare:
            from tests.server import Server

            extra = args.server_args.split()
            print("starting colocated and disaggregated servers...", file=sys.stderr, flush=True)
            servers = [("colocated", Server("--mode", "colocated", *extra, ready_timeout=300)),
                       ("disaggregated", Server(*extra, ready_timeout=300))]
            targets = [(label, s.url + "/v1") for label, s in servers]
        else:
            targets = [("server", args.url.rstrip("/"))]
        for c in args.concurrency:
            n = max(args.requests_per_level, c)
            for label, url in targets:  # interleaved: one level of each before the next level
                print(f"  {label}: concurrency {c}, {n} requests...", file=sys.stderr, flush=True)
                levels.append(asyncio.run(run_level(url, args.model, args.key, label, c, n, args.max_tokens)))
    finally:
        for _, s in servers:
            s.stop()

    print_table(levels)
    report = {"levels": [asdict(lv) for lv in levels]}
    if args.compare:
        ratios = {}
        for c in args.concurrency:
            a, b = (next(lv for lv in levels if lv.label == name and lv.concurrency == c)
                    for name in ("colocated", "disaggregated"))
            ratios[c] = b.output_tok_s / a.output_tok_s
        report["disaggregated_over_colocated_throughput"] = ratios
        print("\ndisaggregated / colocated output tok/s: " + ", ".join(f"c={c}: {r:.2f}" for c, r in ratios.items()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
