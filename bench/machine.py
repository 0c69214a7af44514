"""The CPU a benchmark ran on, as every benchmark records it beside its figures."""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu() -> dict:
    """The CPU model, the cores this process may use and the flags that pick kvfence's kernels."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    model, flags = fields.get("model name", platform.processor()), set(fields.get("flags", "").split())
    return {"model": model, "cores": len(os.sched_getaffinity(0)), "flags": [f for f in CPU_FLAGS if f in flags]}
