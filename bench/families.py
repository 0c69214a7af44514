"""Decode speed of each model family kvfence computes (docs/models.md's family table): batch 1 and batch 8.

Each family's random-weight model is built with its own transformers config class at SmolLM2-135M's size
(hidden 576, 30 layers, 9 query and 3 K/V heads of 64, MLP 1536, vocabulary 49,152, tied embeddings; the
family's own layout where it has one: see ``FAMILIES``), saved as a bf16 HF directory, loaded by kvfence in bf16
on the CPU and driven in process by the colocated ``Engine`` (``bench/decode.py``'s ``KvfenceRunner``): prompts
of 128 tokens, greedy, EOS ignored; tok/s counts the tokens of the decode steps alone (prefill done first). One
thread by default: on a 2-core host that runs anything else, two threads wait on each other's core (a first try
with two, while other work loaded the host, ran at a fifth of the one-thread rate).

    .venv/bin/python bench/families.py [--threads 1] [--new-tokens 32] [--rounds 1] [--json bench/results/families.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import machine  # noqa: E402
from bench.decode import KvfenceRunner, weight_bytes_per_token  # noqa: E402
from kvfence.model import kernels  # noqa: E402
from kvfence.model.loader import load_model  # noqa: E402
from tests.tiny_models import SMOLLM2_SHAPE, write_model  # noqa: E402

BASE = dict(SMOLLM2_SHAPE, head_dim=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=384, norm_topk_prob=True)
# family -> its layout beyond BASE, after a real checkpoint of the family: Mistral-7B-v0.1's 4096 window; Phi-3-mini's
# heads (one K/V head per query head) and 2047 window; Gemma 2's alternating 4096 windows, soft caps and query scale;
# Gemma 3 1B's five 512-token sliding layers per global one; MoE: 8 experts of 384, top 2 (Qwen3-MoE every layer
# sparse; GLM-4-MoE a dense first layer, one shared expert, one group, q/k/v bias, rope on half of each head)
FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": dict(sliding_window=4096),
    "phi3": dict(num_key_value_heads=9, sliding_window=2047),
    "gemma2": dict(sliding_window=4096, query_pre_attn_scalar=64, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3": dict(sliding_window=512, query_pre_attn_scalar=64,
                   layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5),
    "qwen3_moe": dict(MOE, num_experts=8, mlp_only_layers=[], decoder_sparse_step=1),
    "glm4_moe": dict(MOE, n_routed_experts=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, attention_bias=True, partial_rotary_factor=0.5),
}


def cpu() -> dict:
    """The CPU record (``bench/machine.py``) and the C kernels' capabilities."""
    return {**machine.cpu(), "kernels": kernels.detect().summary()}


def measure(family: str, new_tokens: int, rounds: int) -> dict:
    """Build ``family``'s model in a temp dir, load it in bf16 and time batch-1 and batch-8 decode (best of
    ``rounds``)."""
    with tempfile.TemporaryDirectory(prefix=f"kvfence-bench-{family}-") as tmp:
        t0 = time.perf_counter()
        write_model(BASE | FAMILIES[family], family, 1, torch.bfloat16, Path(tmp))
        built = time.perf_counter() - t0
        loaded = load_model(tmp, dtype=torch.bfloat16)
    runner = KvfenceRunner(loaded, torch.bfloat16, "cpu")
    runner.decode_tok_s(1, 2)  # warm: kernels, calibration, first-touch pages
    gc.collect()
    gc.freeze()  # as a server does: a full collection stalls decode steps
    try:
        speeds = {b: max(runner.decode_tok_s(b, new_tokens) for _ in range(rounds)) for b in (1, 8)}
    finally:
        gc.unfreeze()
    cfg = loaded.config
    return {"family": family, "layers": cfg.num_layers, "sparse_layers": len(cfg.sparse_layers),
            "experts": cfg.num_experts, "backend": loaded.model.backend.name, "why": loaded.model.backend_reason,
            "weight_mb": weight_bytes_per_token(loaded.model) / 1e6, "build_s": built,
            "decode_batch1_tok_s": speeds[1], "decode_batch8_tok_s": speeds[8]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per sequence per decode run")
    ap.add_argument("--rounds", type=int, default=1, help="decode runs per batch size (best is kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch's and the C kernels' threads")
    ap.add_argument("--json", default="bench/results/families.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # before any load: calibrated row blocks hold for this count
    t0, rows = time.perf_counter(), []
    for family in args.families:
        rows.append(measure(family, args.new_tokens, args.rounds))
        r = rows[-1]
        print(f"  {family}: {r['decode_batch1_tok_s']:.1f} / {r['decode_batch8_tok_s']:.1f} tok/s ({r['backend']})",
              file=sys.stderr, flush=True)
        gc.collect()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    result = {"date": datetime.date.today().isoformat(), "commit": commit.stdout.strip(), "cpu": cpu(),
              "threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "rounds": args.rounds,
              "total_s": time.perf_counter() - t0, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    c = result["cpu"]
    when = f"{result['date']}, {result['commit']}"
    print(f"\n{c['model']} ({c['cores']} cores, {torch.get_num_threads()} threads), {when}")
    print(f"flags: {' '.join(c['flags'])}\nC kernels: {c['kernels']}\n")
    print(f"{'family':<11}{'layers':>7}{'weights MB':>12}{'batch 1':>9}{'batch 8':>9}  backend")
    for r in rows:
        print(f"{r['family']:<11}{r['layers']:>7}{r['weight_mb']:>12.0f}{r['decode_batch1_tok_s']:>9.1f}"
              f"{r['decode_batch8_tok_s']:>9.1f}  {r['backend']}")
    print(f"\nwrote {args.json} in {result['total_s']:.0f}s")


if __name__ == "__main__":
    main()
