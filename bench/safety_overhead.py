"""What the safety layers cost: every layer on against ``KVFENCE_UNSAFE=all``, same deployment, one run.

Starts two disaggregated servers (1 prefill + 1 decode, shm) that differ only in the layers, then measures them
in alternation (A, B, A, B, ... per concurrency level), so drift on a shared machine hits both alike. Reports
output tokens/s, p99 TTFT and mean TPOT per level (median over rounds) and the ratio on/off. Both servers get the
same prompts (``bench/serve.py``'s workload, unique per round).

    .venv/bin/python bench/safety_overhead.py [--concurrency 1 16] [--rounds 3] [--requests 32]

Writes JSON (``--json``) and prints a table. Target: the layers cost under 1%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import Client, Run, calibrate, closed_loop  # noqa: E402
from tests.server import Server  # noqa: E402

MODES = {"layers on": {}, "layers off": {"KVFENCE_UNSAFE": "all"}}


def median_level(runs: list[Run]) -> dict:
    keys = ("output_tok_s", "ttft_p99", "tpot_mean")
    return {k: statistics.median(getattr(run, k) for run in runs) for k in keys} | {
        "failures": sum(run.failures for run in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3, help="alternations per level")
    ap.add_argument("--requests", type=int, default=32, help="requests per round (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=204)
    ap.add_argument("--server-args", default="", help="extra 'kvfence serve' arguments for both servers")
    ap.add_argument("--json", default="bench/results/safety_overhead.json")
    args = ap.parse_args()

    print("starting a server with every layer on and one with KVFENCE_UNSAFE=all...", file=sys.stderr, flush=True)
    extra = args.server_args.split()
    servers = {mode: Server(*extra, env=env, ready_timeout=300) for mode, env in MODES.items()}
    runs: dict[tuple[str, int], list[Run]] = {}
    try:
        clients = {mode: Client(server.url + "/v1", None, "none") for mode, server in servers.items()}
        words = calibrate(clients["layers on"], args.prompt_tokens)
        for client in clients.values():  # the first requests of a server pay its warm-up: not measured
            asyncio.run(closed_loop(client, "warm-up", 1, 2, words, 8, 10**6))
        first_id = 1
        for c in args.concurrency:
            n = max(args.requests, c)
            for r in range(args.rounds):
                for mode, client in clients.items():
                    print(f"  c={c} round {r + 1}/{args.rounds}: {mode}...", file=sys.stderr, flush=True)
                    run = asyncio.run(closed_loop(client, mode, c, n, words, args.max_tokens, first_id))
                    runs.setdefault((mode, c), []).append(run)
                first_id += n
    finally:
        for server in servers.values():
            server.stop()

    rows = []
    print(f"\n{'conc':>5}{'mode':>12}{'out tok/s':>11}{'TTFT p99':>10}{'TPOT mean':>10}{'failed':>8}")
    for c in args.concurrency:
        on, off = median_level(runs[("layers on", c)]), median_level(runs[("layers off", c)])
        for mode, m in (("layers on", on), ("layers off", off)):
            print(f"{c:>5}{mode:>12}{m['output_tok_s']:>11.1f}{m['ttft_p99'] * 1e3:>8.0f}ms"
                  f"{m['tpot_mean'] * 1e3:>8.1f}ms{m['failures']:>8}")
        cost = 1 - on["output_tok_s"] / off["output_tok_s"]
        print(f"{c:>5}{'cost':>12}{cost * 100:>10.2f}%{(on['ttft_p99'] / off['ttft_p99'] - 1) * 100:>9.1f}%"
              f"{(on['tpot_mean'] / off['tpot_mean'] - 1) * 100:>9.1f}%")
        rows.append({"concurrency": c, "on": on, "off": off, "throughput_cost": cost})
    report = {"rows": rows, "runs": {f"{m}@{c}": [asdict(run) for run in mode_runs]
                                     for (m, c), mode_runs in runs.items()}, "args": vars(args)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
