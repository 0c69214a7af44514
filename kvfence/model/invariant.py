"""Batch-invariant ``x @ w.T``: every output row is bit-identical whatever else is in the call.

BLAS libraries pick their kernel, and with it the order of the K reduction, from the number of rows M. Measured
on this machine kind (torch 2.13, oneDNN with AMX, 2 threads): in bf16, M <= 32 reproduces M = 1 exactly but
many larger M do not (576x960: 33..479 and 1441..1918 differ; 576x3072: 33..704); in fp32 (MKL), M = 1, M = 2..15
and M >= 16 are three different kernels for some shapes, and M = 58..190 a fourth for 1536x576. Which M are safe
is a property of (shape, dtype, thread count, library, CPU), so it is measured here rather than assumed.

``calibrate`` finds a canonical way to compute one row (alone, in a zero-padded call of ``min_rows`` rows), the
largest ``small_max`` such that every M in [min_rows, small_max] reproduces it at every position, and the larger
call sizes (``big``) that do too. ``matmul`` then splits x into blocks of verified sizes only, padding the last one
when that is cheaper than several small calls. A call of one row is always consistent with itself, so the worst
case (``RowBlocks(1, 1)``) is slow but never wrong.

The probe makes any change of reduction order visible: every row holds +H and -H (H = 2**14) at the two ends of K,
so partial sums stay large while the exact result is small, and a different order changes most output elements
(measured: thousands of mismatches per call where random data shows 0..7).
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

BIG_CANDIDATES = (64, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
# Small M checked (each kernel switch seen so far sits at 2, 4, 16, 33 or 58); the scan stops at the first failure.
SMALL_SCAN = (1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 17, 20, 24, 28, 31, 32, 33, 40, 48, 56, 57, 58, 64)
PROBE_ROWS = 16  # distinct probe rows; longer probes repeat them
_SMALL_COST = 3.0  # a row in a call of <= 32 rows costs about this many rows of a large call (measured 2.5..4.5)


@dataclass(frozen=True)
class RowBlocks:
    """Verified call sizes for one weight shape: any M in ``min_rows..small_max``, and each size in ``big``.

    ``big_cols`` > 0: big calls compute the output ``big_cols`` columns (weight rows) at a time, which some shapes
    need for a useful set of big sizes (576x3072 bf16: none below 768 whole, from 384 in blocks of 768).
    """

    min_rows: int
    small_max: int
    big: tuple[int, ...] = ()
    big_cols: int = 0
    _plans: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict, compare=False, repr=False)

    def split(self, rows: int) -> tuple[tuple[int, int], ...]:
        """``(rows, call_rows)`` per block, in order; only the last block may be padded (call_rows > rows)."""
        plan = self._plans.get(rows)
        if plan is None:
            plan = self._plans[rows] = tuple(self._split(rows))
        return plan

    def _split(self, rem: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while rem > self.small_max:
            fits = max((c for c in self.big if c <= rem), default=0)
            if fits:  # a full verified call, no padding
                out.append((fits, fits))
                rem -= fits
                continue
            up = min((c for c in self.big if c >= rem), default=0)
            if up and up < _SMALL_COST * rem:  # one padded call beats several small ones
                return [*out, (rem, up)]
            break
        while rem > 0:
            n = min(rem, self.small_max)
            out.append((n, max(n, self.min_rows)))
            rem -= n
        return out


def matmul(x: torch.Tensor, w: torch.Tensor, blocks: RowBlocks) -> torch.Tensor:
    """``x @ w.T`` for x ``[T, K]`` and w ``[N, K]`` (both contiguous), in verified row blocks -> ``[T, N]``."""
    rows, plan = x.shape[0], blocks.split(x.shape[0])
    if len(plan) == 1 and plan[0][1] == rows:
        return _call(x, w)  # one call, no padding (every decode step)
    padded = rows + plan[-1][1] - plan[-1][0]
    x = _pad(x, padded)
    out = x.new_empty(padded, w.shape[0])
    start = 0
    for _, call in plan:
        cols = blocks.big_cols if call > blocks.small_max else 0
        _call(x[start : start + call], w, out[start : start + call], cols)
        start += call
    return out if padded == rows else out[:rows]


@functools.cache
def calibrate(
    n: int, k: int, dtype: torch.dtype, device: str = "cpu", threads: int = 0, max_rows: int = 2048, big: bool = True
) -> RowBlocks:
    """Verified row blocks for a ``[n, k]`` weight of ``dtype``.

    ``threads`` (the torch thread count) only keys the cache. ``big=False`` skips the large call sizes: for a weight
    that sees few rows per call (an lm_head), where checking them would cost seconds.
    """
    w, x = _probe(n, k, max_rows if big else max(SMALL_SCAN), dtype, device)
    options = []
    for min_rows in (1, 4, 16):
        canon = _canonical(x[:PROBE_ROWS], w, min_rows)  # [PROBE_ROWS, n]
        ref = canon.repeat(math.ceil(x.shape[0] / PROBE_ROWS), 1)  # row i of any verified call == ref[i]
        small_max = _small_max(x, w, ref, min_rows)
        if small_max < min_rows:
            continue
        sizes, cols = _big_sizes(x, w, ref, small_max, max_rows) if big and small_max >= 8 else ((), 0)
        options.append(RowBlocks(min_rows, small_max, sizes, cols))
        if small_max >= 8:  # the smallest padding that gives useful small calls: decode stays cheap
            break
    best = max(options, key=lambda o: o.small_max, default=RowBlocks(1, 1))
    log.debug("row blocks for [%d, %d] %s: %s", n, k, dtype, best)
    return best


def _call(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, cols: int = 0) -> torch.Tensor:
    """The one GEMM entry point, for calibration and inference alike: ``out`` (rows of a contiguous buffer)
    ``= x @ w.T``, ``cols`` output columns at a time when > 0; one row goes through ``mv``, which is faster."""
    if out is None:
        out = x.new_empty(x.shape[0], w.shape[0])
    if x.shape[0] == 1:
        torch.mv(w, x[0], out=out[0])
    elif cols:
        for j in range(0, w.shape[0], cols):
            torch.mm(x, w[j : j + cols].t(), out=out[:, j : j + cols])
    else:
        torch.mm(x, w.t(), out=out)
    return out


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def _probe(n: int, k: int, rows: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight ``[n, k]`` and rows ``[rows, k]`` whose products cancel: +H w at k=0, -H w at k=-1."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(PROBE_ROWS, k, generator=gen)
    w[:, 0] = w[:, -1] = 1.0
    x[:, 0], x[:, -1] = 2.0**14, -(2.0**14)
    x = x.repeat(math.ceil(rows / PROBE_ROWS), 1)[:rows]
    return w.to(device, dtype), x.to(device, dtype)


def _canonical(x: torch.Tensor, w: torch.Tensor, min_rows: int) -> torch.Tensor:
    """Each row of x computed alone, at position 0 of a zero-padded call of ``min_rows`` rows."""
    return torch.cat([_call(_pad(x[i : i + 1], min_rows), w)[:1] for i in range(x.shape[0])])


def _small_max(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, min_rows: int) -> int:
    best = 0
    for m in (m for m in SMALL_SCAN if m >= min_rows):
        if not torch.equal(_call(x[:m], w), ref[:m]):
            break
        best = m
    return best


def _big_sizes(
    x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, small_max: int, max_rows: int
) -> tuple[tuple[int, ...], int]:
    """Verified big call sizes, and the column block they need (0: whole). Splits are tried only when the
    whole-width calls verify nothing up to 512 rows, the size of a prefill chunk."""
    n, best = w.shape[0], (_verified_big(x, w, ref, small_max, max_rows, 0), 0)
    for cols in (n // 2, n // 4):
        if min(best[0], default=max_rows + 1) <= 512 or n % cols or cols % 64 or cols < 256:
            break
        sizes = _verified_big(x, w, ref, small_max, max_rows, cols)
        if min(sizes, default=max_rows + 1) < min(best[0], default=max_rows + 1):
            best = (sizes, cols)
    return best


def _verified_big(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, small_max: int, max_rows: int, cols: int):
    fits = (c for c in BIG_CANDIDATES if small_max < c <= max_rows)
    return tuple(c for c in fits if torch.equal(_call(x[:c], w, cols=cols), ref[:c]))


# Decode attention: one SDPA call for a group of same-length sequences (one query per head each) instead of one
# call per sequence, where a backend proves batch-invariant. Flash-style kernels may split the keys by how many
# (batch, head) problems fill the device, which changes a row's reduction order with the group size.
DECODE_GROUPS = (2, 3, 8, 31, 64)
DECODE_LENGTHS = (1, 37, 300, 1100, 2100)


def decode_attention_backend(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, device: str):
    """The first SDPA backend (flash, memory-efficient, cuDNN, math) under which every sequence of a batched decode
    call ``q [n, KV, G, D]`` over ``k, v [n, KV, S, D]`` gets the bits it gets in a call of its own, for the group
    sizes and lengths above; None if none does (callers then make one call per sequence)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    n = max(DECODE_GROUPS)
    candidates = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                  SDPBackend.MATH)
    for backend in candidates:
        try:
            with sdpa_kernel(backend), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a backend that does not take these inputs warns, then raises
                if all(_decode_calls_agree(n, kv_heads, group, head_dim, s, dtype, device, gen)
                       for s in DECODE_LENGTHS):
                    log.info("decode attention: one %s call per group of same-length sequences", backend.name)
                    return backend
        except RuntimeError:  # this backend does not take these inputs here
            continue
    return None


def _decode_calls_agree(n: int, kv_heads: int, group: int, head_dim: int, length: int, dtype: torch.dtype,
                        device: str, gen: torch.Generator) -> bool:
    q = torch.randn(n, kv_heads, group, head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(n, kv_heads, length, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    alone = torch.cat([sdpa(q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i in range(n)])
    return all(torch.equal(sdpa(q[:m], k[:m], v[:m]), alone[:m]) for m in DECODE_GROUPS)
