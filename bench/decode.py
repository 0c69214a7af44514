"""Prefill and decode speed of the colocated engine, against transformers and the memory-bandwidth limit.

Runs everything in one process and interleaves kvfence and transformers
rounds, so the ratios hold even on a noisy shared machine.

    .venv/bin/python bench/decode.py [--rounds 2] [--json bench/results/decode.json]
    python bench/decode.py --device cuda --model HF_DIR   # on a GPU (scripts/cuda_check.sh)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfence.config import EngineConfig  # noqa: E402
from kvfence.core import Request, SamplingParams  # noqa: E402
from kvfence.engine.engine import Engine  # noqa: E402
from kvfence.model.loader import load_model, smollm2_gguf_path  # noqa: E402
from kvfence.model.memory import freeze_loaded_objects  # noqa: E402

PROMPT_LEN = 128


def prompt_ids(tokenizer, n: int, salt: int = 0) -> list[int]:
    text = " ".join(f"item {salt}-{i}: the quick brown fox jumps over the lazy dog." for i in range(n))
    ids = tokenizer.encode(text)
    assert len(ids) >= n, "prompt text too short"
    return ids[:n]


def sync(device: str) -> None:
    """Wait for the device's queued work (a GPU runs ahead of the timer)."""
    if device == "cuda":
        torch.cuda.synchronize()


def memory_bandwidth_gbs(device: str) -> float:
    """Read bandwidth of a streaming pass over a tensor far larger than the caches (best of 10).

    The pass is a float32 sum, which keeps up with memory. (A bfloat16 sum with float32 accumulation does not:
    it runs at ~0.5 GB/s on CPU, and measured the kernel, not the memory.)
    """
    x = torch.ones((4096 if device == "cuda" else 512) * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(10):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def weight_bytes_per_token(model) -> int:
    """Bytes of weights read per decoded token: every parameter once (the embedding gather is negligible)."""
    seen, total = set(), 0
    for t in model.backend.decode_weights():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total


class KvfenceRunner:
    def __init__(self, loaded, dtype, device: str):
        self.loaded = loaded
        cfg = EngineConfig(max_context=4096, kv_pool_tokens=40 * 1024, page_size=16, max_batch=64)
        self.engine = Engine(loaded.model, loaded.tokenizer, cfg, dtype, device)

    def prefill_seconds(self, n: int) -> float:
        req = Request(prompt_ids(self.loaded.tokenizer, n), SamplingParams(max_tokens=1, temperature=0))
        self.engine.add(req)
        t = time.perf_counter()
        while self.engine.has_work:
            self.engine.step()
        return time.perf_counter() - t

    def decode_tok_s(self, batch: int, new_tokens: int) -> float:
        for b in range(batch):
            params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
            self.engine.add(Request(prompt_ids(self.loaded.tokenizer, PROMPT_LEN, b), params))
        while any(s.in_prefill or not s.req.output_ids for s in self.engine.scheduler.running) or \
                self.engine.scheduler.waiting:
            self.engine.step()
        t, produced = time.perf_counter(), 0
        while self.engine.has_work:
            produced += len(self.engine.step())
        return produced / (time.perf_counter() - t)


class TransformersRunner:
    def __init__(self, model: str, dtype, device: str):
        from transformers import AutoModelForCausalLM

        if model == "smollm2-135m":
            path = smollm2_gguf_path()
            hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        self.model, self.device = hf.to(device).eval(), device

    def _generate(self, ids: torch.Tensor, n: int) -> float:
        ids = ids.to(self.device)
        sync(self.device)
        t = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=2)
        sync(self.device)
        return time.perf_counter() - t

    def prefill_seconds(self, tokenizer, n: int) -> float:
        return self._generate(torch.tensor([prompt_ids(tokenizer, n)]), 1)

    def decode_tok_s(self, tokenizer, batch: int, new_tokens: int) -> float:
        ids = torch.tensor([prompt_ids(tokenizer, PROMPT_LEN, b) for b in range(batch)])
        full, first = self._generate(ids, new_tokens), self._generate(ids, 1)
        return batch * (new_tokens - 1) / (full - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per measurement (best is kept)")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="tokens per decode run (enough that one stall does not decide it)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--json", default="bench/results/decode.json")
    ap.add_argument("--model", default="smollm2-135m", help="as for kvfence serve (a GPU run takes an HF directory)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    dtype, device = torch.bfloat16, args.device
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=dtype, device=device)
    kv = KvfenceRunner(loaded, dtype, device)
    warm = Request(prompt_ids(loaded.tokenizer, 16), SamplingParams(max_tokens=1, temperature=0))
    kv.engine.add(warm)
    while not warm.output_ids:
        kv.engine.step()
    start_to_first_token = time.perf_counter() - t0
    hf = None if args.no_transformers else TransformersRunner(args.model, dtype, device)
    freeze_loaded_objects()  # as a server does; a full collection over both models stalled 32-token decode runs

    rows: list[dict] = []

    def measure(name: str, unit: str, ours, theirs, better: str) -> None:
        a, b = [], []
        for _ in range(args.rounds):
            a.append(ours())
            if hf:
                b.append(theirs())
        pick = max if better == "higher" else min
        row = {"workload": name, "unit": unit, "kvfence": pick(a), "transformers": pick(b) if b else None}
        if b:
            ours, theirs = row["kvfence"], row["transformers"]
            row["ratio"] = ours / theirs if better == "higher" else theirs / ours
        rows.append(row)
        reference = f", transformers {row['transformers']:.2f}" if b else ""
        print(f"  {name}: kvfence {row['kvfence']:.2f} {unit}{reference}", file=sys.stderr, flush=True)

    tok = loaded.tokenizer
    for n in (512, 2048):
        measure(f"prefill {n} tokens", "tok/s", lambda n=n: n / kv.prefill_seconds(n),
                lambda n=n: n / hf.prefill_seconds(tok, n), "higher")
    for batch in (1, 8, 32):
        measure(f"decode batch {batch}", "tok/s", lambda b=batch: kv.decode_tok_s(b, args.new_tokens),
                lambda b=batch: hf.decode_tok_s(tok, b, args.new_tokens), "higher")

    bandwidth = memory_bandwidth_gbs(device)
    wbytes = weight_bytes_per_token(loaded.model)
    limit = bandwidth * 1e9 / wbytes
    batch1 = next(r for r in rows if r["workload"] == "decode batch 1")["kvfence"]
    result = {
        "model": loaded.name, "dtype": str(dtype), "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "rows": rows,
        "memory_bandwidth_gbs": bandwidth, "weight_bytes_per_token": wbytes,
        "decode_batch1_limit_tok_s": limit, "decode_batch1_fraction_of_limit": batch1 / limit,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "start_to_first_token_s": start_to_first_token,
    }
    if device == "cuda":
        result["peak_gpu_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
        backend = loaded.model.backend.decode_sdpa
        result["decode_attention"] = f"one {backend.name} call per group" if backend else "one call per sequence"
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\n{'workload':<22}{'kvfence':>12}{'transformers':>14}{'ratio':>8}")
    for r in rows:
        theirs = f"{r['transformers']:.1f}" if r["transformers"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else "-"
        print(f"{r['workload']:<22}{r['kvfence']:>12.1f}{theirs:>14}{ratio:>8}")
    print(f"\nmemory bandwidth {bandwidth:.1f} GB/s, weights {wbytes / 1e6:.0f} MB/token -> batch-1 limit "
          f"{limit:.1f} tok/s; kvfence reaches {100 * batch1 / limit:.0f}%")
    gpu = (f", peak GPU memory {result['peak_gpu_memory_mib']:.0f} MiB, decode attention: "
           f"{result['decode_attention']}" if device == "cuda" else "")
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB{gpu} (transformers loaded too: {hf is not None}), "
          f"start to first token {start_to_first_token:.1f}s")
    ratios = [r["ratio"] for r in rows if r.get("ratio")] or [0]
    print(f"wrote {args.json}; median of ratios {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
