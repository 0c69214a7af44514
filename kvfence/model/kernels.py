"""The decode matmul (``decode_gemm.c``): built once per machine with the system C compiler, called via ctypes.

``gemm(x, w)`` computes ``x @ w.T`` in bfloat16 with every row independent of the others by construction (see the
C file), so it needs no calibration and is as fast for 1 row as per row for 64. It is optional: ``available()`` is
False without a C compiler, on a CPU without AVX512-BF16, or with ``KVFENCE_DECODE_GEMM=0``; the model then uses
``invariant.matmul`` for every row. Either way a process uses one of the two throughout, so invariance holds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_gemm.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-fPIC", "-shared"]


def _cpu_has(*features: str) -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return set(features) <= set(flags.split(":", 1)[1].split())


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVFENCE_DECODE_GEMM", "1") == "0" or not _SOURCE.exists():
        return None
    if not _cpu_has("avx512f", "avx512bw", "avx512_bf16"):
        return None
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        log.warning("no C compiler: decode matmuls fall back to torch (slower)")
        return None
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join([cc, *_FLAGS]).encode()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"kvfence-kernels-{os.getuid()}" / f"decode_gemm-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("building %s failed (%s): decode matmuls fall back to torch (slower)", _SOURCE.name, e)
            return None
        os.replace(tmp, lib)  # atomic: concurrent builders each publish a complete file
    so = ctypes.CDLL(str(lib))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (so.kvf_gemm_bf16, so.kvf_gemm_amx):
        fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int]
        fn.restype = None
    so.amx = _cpu_has("amx_bf16", "amx_tile") and so.kvf_amx_init() == 1
    return so


def available() -> bool:
    return _library() is not None


def gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, amx: bool | None = None) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ w [N, K].T`` in bfloat16 on CPU; rows of x and out may have any row stride."""
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16)
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise TypeError("decode gemm is bfloat16 only")
    if x.stride(1) != 1 or not w.is_contiguous() or out.stride(1) != 1 or w.shape[1] != K or out.shape != (M, N):
        raise ValueError(f"decode gemm: bad layout {tuple(x.shape)} x {tuple(w.shape)} -> {tuple(out.shape)}")
    lib = _library()
    fn = lib.kvf_gemm_amx if (lib.amx if amx is None else amx) and K % 32 == 0 and N % 16 == 0 else lib.kvf_gemm_bf16
    fn(
        x.data_ptr(), x.stride(0), w.data_ptr(), K, out.data_ptr(), out.stride(0), M, N, K, torch.get_num_threads()
    )
    return out
