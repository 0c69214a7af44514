"""What the safety layers' own work costs, timed inside one process on the real SmolLM2.

End-to-end A/B runs (bench/safety_overhead.py) swing by more than 1% on a shared machine, so this measures the
layers' work directly, as a share of the work it guards, in the same run. Torch runs on one thread (the
caller's), and every figure is that thread's CPU time, so time spent descheduled by other load does not count:

- **per decode step** (L3): the engine's check of every page a step reads, against the page table and the
  pages' tag records (``Engine._verify``, stamping included), over the whole step, at batch 1, 16 and 64;
- **whole decode steps** with every layer on against ``KVFENCE_UNSAFE=all``, two engines stepping in
  alternating blocks (what the L3 check adds to a step, all effects included);
- **per transfer** (L3 tags, L4 coverage, L5 checksums): prefill's per-page xxh3 and tag record, and decode's
  ``check_landing``, over the prefill compute of the same prompt, at 128, 512 and 2,048 tokens (medians of 7, 5
  and 3 fresh engines: each transfer is checked once, cold, as in serving).

L0, L1 and L2 are a few comparisons per request; L6 and L7 only change when pages are freed and cancels sent.

    .venv/bin/python bench/safety_cost.py [--json bench/results/safety_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfence.config import EngineConfig  # noqa: E402
from kvfence.core import Request, SamplingParams  # noqa: E402
from kvfence.engine.engine import Engine  # noqa: E402
from kvfence.kvcache.layout import check_landing, tokens_per_page, transfer_checksum  # noqa: E402
from kvfence.model.loader import load_model  # noqa: E402
from kvfence.safety import Safety  # noqa: E402

DECODE_STEPS = 48
clock = time.thread_time  # CPU time of this thread: time spent descheduled on a shared machine does not count


def make_engine(loaded, pool_tokens: int, max_context: int, safety: Safety | None = None) -> Engine:
    config = EngineConfig(max_context=max_context, kv_pool_tokens=pool_tokens, page_size=16, max_batch=64,
                          chunk_size=512)
    return Engine(loaded.model, loaded.tokenizer, config, torch.bfloat16, safety=safety or Safety(),
                  remote_writes=True)


def decoding_engine(loaded, batch: int, steps: int, safety: Safety | None = None) -> Engine:
    """An engine with ``batch`` requests of 128 prompt tokens, prefilled, each with ``steps`` decode steps left."""
    engine = make_engine(loaded, pool_tokens=batch * (128 + steps + 32), max_context=128 + steps + 16,
                         safety=safety)
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 100 for j in range(128)]
        engine.add(Request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True), "t", rid=i + 1))
    while any(not s.req.output_ids for s in engine.seqs.values()):  # prefill, untimed
        engine.step()
    return engine


def timed_verify(engine: Engine) -> list[float]:
    """Wrap the engine's L3 check so each call's seconds are recorded."""
    spent: list[float] = []
    inner = engine._verify

    def verify(work):
        t = clock()
        try:
            return inner(work)
        finally:
            spent.append(clock() - t)

    engine._verify = verify
    return spent


def decode_step_cost(loaded, batch: int) -> dict:
    engine = decoding_engine(loaded, batch, DECODE_STEPS)
    spent = timed_verify(engine)
    t = clock()
    for _ in range(DECODE_STEPS):
        engine.step()
    step_s = (clock() - t) / DECODE_STEPS
    verify_s = sum(spent) / len(spent)
    return {"batch": batch, "step_ms": step_s * 1e3, "l3_us": verify_s * 1e6, "share": verify_s / step_s}


def decode_ab(loaded, batch: int, rounds: int, block: int = 4) -> dict:
    """Whole decode steps with every layer on against every layer off, in alternating blocks of ``block``."""
    engines = {"on": decoding_engine(loaded, batch, rounds * block), "off": decoding_engine(
        loaded, batch, rounds * block, Safety.from_env("all"))}
    spent = {"on": 0.0, "off": 0.0}
    for r in range(rounds):
        for mode, engine in list(engines.items())[:: 1 if r % 2 else -1]:  # neither always goes first
            t = clock()
            for _ in range(block):
                engine.step()
            spent[mode] += clock() - t
    n = rounds * block
    return {"batch": batch, "steps": n, "on_ms": spent["on"] / n * 1e3, "off_ms": spent["off"] / n * 1e3,
            "cost": spent["on"] / spent["off"] - 1}


def transfer_cost(loaded, tokens: int) -> dict:
    engine = make_engine(loaded, pool_tokens=tokens + 64, max_context=tokens + 16)
    rid = 99
    prompt = [(j * 13) % 1000 + 100 for j in range(tokens)]
    engine.add(Request(prompt, SamplingParams(max_tokens=2), "t", rid=rid))
    t = clock()
    while not engine.seqs[rid].req.output_ids:
        engine.step()
    prefill_s = clock() - t
    region, ps = engine.pool.region, engine.config.page_size
    grants = [(g.page, g.epoch) for g in engine.seqs[rid].grants]
    counts = tokens_per_page(tokens, ps, len(grants))
    t = clock()
    sums = []
    for (page, epoch), n in zip(grants, counts, strict=True):  # what prefill adds per page (PrefillRunner._ship)
        checksum = region.page_checksum(page, n)
        region.write_tag(page, rid, epoch, page, n, checksum)
        sums.append(checksum)
    send_s = clock() - t
    t = clock()
    problem = check_landing(region, rid, grants, tokens, transfer_checksum(sums), tags=True, coverage=True,
                            checksum=True)
    land_s = clock() - t
    assert problem is None, problem
    return {"tokens": tokens, "prefill_ms": prefill_s * 1e3, "tag_and_sum_ms": send_s * 1e3,
            "check_landing_ms": land_s * 1e3, "share": (send_s + land_s) / prefill_s}


def median_run(runs: list[dict]) -> dict:
    """Per field, the median over ``runs`` (each a fresh engine and prefill: one cold transfer is one sample)."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {"repeats": len(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/safety_cost.json")
    ap.add_argument("--rounds", type=int, default=12, help="alternations of the on/off decode A/B")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("loading SmolLM2...", file=sys.stderr, flush=True)
    loaded = load_model("smollm2-135m", dtype=torch.bfloat16)
    steps = []
    for batch in (1, 16, 64):
        print(f"  decode steps at batch {batch}...", file=sys.stderr, flush=True)
        steps.append(decode_step_cost(loaded, batch))
    ab = []
    for batch in (1, 16):
        print(f"  decode steps at batch {batch}, layers on and off in alternation...", file=sys.stderr, flush=True)
        ab.append(decode_ab(loaded, batch, rounds=args.rounds))
    transfers = []
    for tokens, repeats in ((128, 7), (512, 5), (2048, 3)):
        print(f"  a {tokens}-token transfer, {repeats} times...", file=sys.stderr, flush=True)
        runs = [transfer_cost(loaded, tokens) for _ in range(repeats)]
        transfers.append(median_run(runs))
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch_threads": torch.get_num_threads(),
              "decode_steps": steps, "decode_ab": ab, "transfers": transfers}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print("\nL3 per decode step (checks of every page read, stamping included)")
    print(f"{'batch':>6} {'step ms':>9} {'L3 us':>8} {'share':>7}")
    for r in steps:
        print(f"{r['batch']:>6} {r['step_ms']:>9.2f} {r['l3_us']:>8.1f} {r['share']:>7.2%}")
    print("\nWhole decode steps, every layer on vs KVFENCE_UNSAFE=all, alternating blocks")
    print(f"{'batch':>6} {'steps':>6} {'on ms':>8} {'off ms':>8} {'cost':>7}")
    for r in ab:
        print(f"{r['batch']:>6} {r['steps']:>6} {r['on_ms']:>8.2f} {r['off_ms']:>8.2f} {r['cost']:>7.2%}")
    print("\nL3-L5 per transfer (prefill's tags and xxh3, decode's check_landing) vs the prompt's prefill")
    print(f"{'tokens':>6} {'prefill ms':>11} {'tags+sums ms':>13} {'landing ms':>11} {'share':>7}")
    for r in transfers:
        print(f"{r['tokens']:>6} {r['prefill_ms']:>11.1f} {r['tag_and_sum_ms']:>13.2f} {r['check_landing_ms']:>11.2f} "
              f"{r['share']:>7.2%}")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
