"""Decode and prefill speed of each CPU flavour this host can run (``KVFENCE_CPU``), A/B interleaved.

One child process per flavour loads the model once (the flavour is fixed per process); the parent then asks them
in turn for each measurement, one child at a time, round after round, and keeps each one's best. So the flavours
see the same host load, and the table says what the kernels of a CPU without AMX (or without AVX-512) would do
on this one's cores and memory.

    .venv/bin/python bench/capabilities.py [--rounds 3] [--flavours amx,avx512,avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu  # noqa: E402

WORKLOADS = [("decode", 1), ("decode", 16), ("prefill", 2048)]
# torch's own kernels (MKL's and oneDNN's bf16 products, ATen's vector code) would still use AMX here: each forced
# flavour caps them to that CPU's instructions too, so the little the forward leaves to torch runs as it would there
TORCH_CAPS = {
    "avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
               "ATEN_CPU_CAPABILITY": "avx512"},
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
# variants beyond the flavours: "avx512-dense" is what an AVX-512 CPU without AMX ran before the kernels of issue #20
# (GGUF blocks dequantized to bf16 at load, no int8, torch's SDPA for prefill attention)
VARIANTS = {"avx512-dense": ("avx512", {"KVFENCE_KEEP_BLOCKS": "0", "KVFENCE_PREFILL_ATTENTION": "0"})}


def child() -> None:
    """Serve measurements over stdin/stdout: ``decode B`` or ``prefill N`` -> one JSON line (tok/s)."""
    from bench.decode import KvfenceRunner
    from kvfence.core import Request, SamplingParams
    from kvfence.model import kernels
    from kvfence.model.loader import load_model
    from kvfence.model.memory import freeze_loaded_objects

    threads = int(os.environ.get("BENCH_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model("smollm2-135m", dtype=torch.bfloat16)
    kv = KvfenceRunner(loaded, torch.bfloat16, "cpu")
    warm = Request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    kv.engine.add(warm)
    while kv.engine.has_work:
        kv.engine.step()
    freeze_loaded_objects()
    print(json.dumps({"caps": kernels.detect().summary()}), flush=True)
    new_tokens = int(os.environ.get("NEW_TOKENS", "128"))
    for line in sys.stdin:
        kind, n = line.split()
        n = int(n)
        rate = kv.decode_tok_s(n, new_tokens) if kind == "decode" else n / kv.prefill_seconds(n)
        print(json.dumps({"tok_s": rate}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flavours", default="amx,avx512,avx2", help=f"KVFENCE_CPU values or {', '.join(VARIANTS)}")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0,
                    help="threads per child (0: torch's default); 1 where other work shares the cores (an OpenMP "
                         "barrier waits for a thread the OS took away)")
    ap.add_argument("--json", default="bench/results/capabilities.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child()
    procs, caps = {}, {}
    for flavour in args.flavours.split(","):
        forced, extra = VARIANTS.get(flavour, (flavour, {}))
        env = {**os.environ, **TORCH_CAPS.get(forced, {}), **extra, "KVFENCE_CPU": forced,
               "NEW_TOKENS": str(args.new_tokens),
               "BENCH_THREADS": str(args.threads)}
        procs[flavour] = subprocess.Popen([sys.executable, __file__, "--child"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env)
    for flavour, p in procs.items():
        caps[flavour] = json.loads(p.stdout.readline())["caps"]
        print(f"{flavour}: {caps[flavour]}", file=sys.stderr, flush=True)
    best: dict[tuple[str, str], float] = {}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for kind, n in WORKLOADS:
            for flavour, p in procs.items():  # one child at a time, in turn
                p.stdin.write(f"{kind} {n}\n")
                p.stdin.flush()
                rate = json.loads(p.stdout.readline())["tok_s"]
                key = (flavour, f"{kind} {n}")
                best[key] = max(best.get(key, 0.0), rate)
                print(f"  round {r + 1} {kind} {n} {flavour}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait(timeout=60)
    host = cpu()
    name, flags = host["model"], " ".join(host["flags"])
    header = "| flavour | " + " | ".join(
        f"{'decode batch' if k == 'decode' else 'prefill'} {n}" for k, n in WORKLOADS) + " |"
    threads = args.threads or torch.get_num_threads()
    lines = [f"CPU: {name}; flags: {flags}; {threads} thread(s) each; best of {args.rounds} interleaved "
             f"rounds ({time.perf_counter() - t0:.0f}s), tok/s", "", header, "|---" * (len(WORKLOADS) + 1) + "|"]
    for flavour in procs:
        lines.append(f"| {flavour} | " + " | ".join(
            f"{best[(flavour, f'{k} {n}')]:.1f}" for k, n in WORKLOADS) + " |")
    print("\n".join(lines))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": name, "flags": flags, "threads": threads, "capabilities": caps,
                                           "rounds": args.rounds,
                                           "tok_s": {f"{f} {w}": v for (f, w), v in best.items()}}, indent=2))


if __name__ == "__main__":
    main()
