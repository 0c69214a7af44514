"""What a decode layer's matmuls cost with GGUF K-quant weights kept in their super-blocks, against bf16 weights.

One Llama-3.2-1B-shaped layer (hidden 2048, 32 heads and 8 KV heads of 64, MLP 8192): its four matmuls, fused as
the model fuses them (qkv [3072, 2048], o [2048, 2048], gate_up [16384, 2048], down [2048, 8192]), for x of 1 and
8 rows, through the entry points the C backend calls (``kernels.gemm_entry``: the K-quant rows expanded to bf16
inside the kernel). Weights are random super-blocks (the cost does not depend on the values). One thread, ms per
layer, best of ``--rounds``; the flavour is this CPU's best unless ``KVFENCE_CPU`` caps it.

    .venv/bin/python bench/kquants.py [--rounds 5] [--json bench/results/kquants.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu  # noqa: E402
from kvfence.model import kernels  # noqa: E402
from kvfence.model.blocks import BLOCK_BYTES, BlockWeight  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 2048, 32, 8, 64, 8192
SHAPES = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
          "gate_up": (2 * FFN, HIDDEN), "down": (HIDDEN, FFN)}
FORMATS = ("bf16", "Q4_K", "Q5_K", "Q6_K")
ROWS = (1, 8)
_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of the fp16 scales in a super-block


def weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor | BlockWeight:
    """A random ``[n, k]`` weight: bf16, or super-blocks of ``fmt`` with small finite fp16 scales."""
    if fmt == "bf16":
        return torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) * 0.02).bfloat16()
    raw = rng.integers(0, 256, (n, k // 256, BLOCK_BYTES[fmt]), dtype=np.uint8)
    for off in _SCALES[fmt]:
        raw[..., off : off + 2] = np.array([1e-4], dtype=np.float16).view(np.uint8)
    return BlockWeight.from_gguf(fmt, raw.reshape(n, -1), (n, k))


def layer_ms(weights: dict[str, torch.Tensor | BlockWeight], rows: int, rounds: int, repeats: int) -> float:
    """Best of ``rounds`` of the mean over ``repeats`` of one pass over the layer's four matmuls, in ms."""
    calls = []
    for name, w in weights.items():
        n, k = SHAPES[name]
        fn, ptr, arg = kernels.gemm_entry(w)
        x, y = torch.randn(rows, k).bfloat16(), torch.empty(rows, n, dtype=torch.bfloat16)
        calls.append((fn, x, ptr, arg, y, n, k))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            for fn, x, ptr, arg, y, n, k in calls:
                fn(x.data_ptr(), k, ptr, arg, y.data_ptr(), n, rows, n, k, 1)
        best = min(best, (time.perf_counter() - t0) / repeats * 1e3)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default="bench/results/kquants.json")
    args = ap.parse_args()
    caps = kernels.detect()
    if not caps.block_weights:
        print(f"no C kernels here ({caps.summary()})")
        return 1
    torch.set_num_threads(1)
    kernels.set_threads(1)
    rng = np.random.default_rng(0)
    table: dict[str, dict[str, float]] = {}
    for fmt in FORMATS:
        weights = {name: weight(fmt, n, k, rng) for name, (n, k) in SHAPES.items()}
        mb = sum(w.nbytes for w in weights.values()) / 1e6
        table[fmt] = {"MB": round(mb, 1)} | {f"rows{r}": round(layer_ms(weights, r, args.rounds, args.repeats), 3)
                                              for r in ROWS}
    print(f"{'weights':<8} {'MB':>7}" + "".join(f" {'ms/layer ' + str(r) + ' row' + 's' * (r > 1):>16}" for r in ROWS))
    for fmt, row in table.items():
        print(f"{fmt:<8} {row['MB']:>7.1f}" + "".join(f" {row[f'rows{r}']:>16.2f}" for r in ROWS))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    host = cpu()
    out.write_text(json.dumps({"cpu": host, "capabilities": caps.summary(), "threads": 1,
                               "layer": SHAPES, "ms_per_layer": table}, indent=2))
    print(f"cpu: {host['model']}\ncapabilities: {caps.summary()}\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
