"""What picking one token costs per row, by sampling mode, over SmolLM2's 49,152-token vocabulary.

The engine samples row by row (each request with its own generator), so at batch B a step pays B times this. One
torch thread, this thread's CPU time, best of ``--rounds``; ``torch.multinomial`` (what the sampler used before)
is timed in the same run for comparison.

    .venv/bin/python bench/sampling.py [--rounds 5] [--json bench/results/sampling.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfence.core import SamplingParams  # noqa: E402
from kvfence.engine.sampler import make_generator, sample  # noqa: E402

VOCAB = 49152
MODES = {
    "greedy": SamplingParams(max_tokens=1, temperature=0.0),
    "temperature 0.7": SamplingParams(max_tokens=1, temperature=0.7, seed=1),
    "temperature 0.7, top_p 0.9": SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, seed=1),
    "temperature 0.7, top_k 50": SamplingParams(max_tokens=1, temperature=0.7, top_k=50, seed=1),
}


def per_row_ms(fn, n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t) / n)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="bench/results/sampling.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # logit spread of a real model
    rows = {}
    for name, p in MODES.items():
        gen = make_generator(p)
        rows[name] = per_row_ms(lambda p=p, gen=gen: sample(logits, [p], [gen]), 200, args.rounds)
    probs, gen = (logits[0] / 0.7).softmax(-1), torch.Generator().manual_seed(1)
    rows["torch.multinomial alone (before)"] = per_row_ms(lambda: torch.multinomial(probs, 1, generator=gen), 100,
                                                          args.rounds)
    print(f"{'mode':<36} {'ms per row':>10}")
    for name, ms in rows.items():
        print(f"{name:<36} {ms:>10.3f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"vocab": VOCAB, "rounds": args.rounds, "ms_per_row": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
