"""The C row kernels: built once per machine with the system C compiler, called via ctypes.

``gemm(x, w)`` computes ``x @ w.T`` in bfloat16 with every row independent of the others by construction (see the
C file), so it needs no calibration; the model runs every matmul row through it, prefill and decode, with bf16
weights or GGUF blocks expanded on the fly (``BlockWeight``), except decode rows of block weights where AMX int8
runs: those multiply ``DecodeBlocks`` with x quantized to int8 per block, exact integer sums. Decode attention,
add + RMSNorm, rotary + K/V write and the MLP's silu(gate) * up are row- or sequence-wise the same way.

Two sources, one set of entry points: ``decode_gemm.c`` for CPUs with AVX512-BF16 (and AMX tiles where present:
block weights, prefill attention), ``decode_avx2.c`` for CPUs with only AVX2, FMA and F16C. Each is batch-invariant
on its own terms; their bits differ. ``KVFENCE_KERNELS=avx2`` builds the AVX2 one on any CPU that has AVX2. They
are optional: ``available()`` is False without a C compiler, on a CPU without AVX2, or with
``KVFENCE_DECODE_GEMM=0``; the model then uses ``invariant.matmul`` for every row. Either way a process uses one of
them throughout.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch

from kvfence.cbuild import build
from kvfence.model.blocks import BlockWeight, DecodeBlocks

_threads = 0  # threads of the C kernels; 0: torch's count
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
# flavour: (source, CPU flags it needs, compiler flags); the first that fits this CPU is built, unless
# KVFENCE_KERNELS names one (tests use it to check the AVX2 source on an AVX-512 host)
_FLAVOURS = {
    "avx512": ("decode_gemm.c", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c"),
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c", "-mamx-tile", "-mamx-bf16",
                "-mavx512vnni", "-mamx-int8"]),
    "avx2": ("decode_avx2.c", ("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
}
_FORMAT_IDS = {"Q4_1": 1, "Q8_0": 2}  # decode_gemm.c's FMT_*


def set_threads(n: int) -> None:
    """Run the C kernels on ``n`` threads (0: torch's count). Their results do not depend on it: threads split
    the rows, sequences or columns, and each is computed by the same instructions whichever thread runs it."""
    global _threads
    _threads = n


def threads() -> int:
    """The thread count the C kernels run on now."""
    return _threads or torch.get_num_threads()


def _cpu_has(*features: str) -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return set(features) <= set(flags.split(":", 1)[1].split())


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVFENCE_DECODE_GEMM", "1") == "0":
        return None
    fits = [name for name, (_, needs, _) in _FLAVOURS.items() if _cpu_has(*needs)]
    forced = os.environ.get("KVFENCE_KERNELS")
    if forced:
        fits = [name for name in fits if name == forced]
    if not fits:
        return None
    source, _, flags = _FLAVOURS[fits[0]]
    source = Path(__file__).with_name(source)
    lib = build(source, [*flags, *_COMMON_FLAGS], deps=sorted(source.parent.glob("*.h")))
    if lib is None:
        return None
    so = ctypes.CDLL(str(lib))
    so.flavour = fits[0]
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    so.kvf_gemm_bf16.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int]
    so.kvf_gemm_bf16.restype = None
    so.amx = _cpu_has("amx_bf16", "amx_tile") and so.kvf_amx_init() == 1
    # block weights' product: on tiles (decode_gemm.c, AMX only; N % 16 == 0) or with AVX2 (decode_avx2.c)
    so.gemm_blocks = so.kvf_gemm_amx_blocks if so.amx else getattr(so, "kvf_gemm_blocks", None)
    if so.gemm_blocks is not None:
        so.gemm_blocks.argtypes = [ptr, i64, ptr, ctypes.c_int, ptr, i64, i64, i64, i64, ctypes.c_int]
        so.gemm_blocks.restype = None
        so.kvf_expand_rows.argtypes = [ptr, ctypes.c_int, ptr, i64, i64, ptr]
        so.kvf_expand_rows.restype = None
    # decode rows of block weights in int8 (VNNI, and AMX int8 from 16 rows): ``DecodeBlocks``
    so.q8 = so.amx and _cpu_has("amx_int8", "avx512_vnni")
    if so.q8:  # and the layers of a decode-only step in one call
        so.kvf_gemm_q8.argtypes = so.gemm_blocks.argtypes
        so.kvf_gemm_q8.restype = None
        so.kvf_decode_layers.argtypes = [ptr, ptr, i64]
        so.kvf_decode_layers.restype = None
    if so.amx:  # the entry points on tiles
        so.kvf_gemm_amx.argtypes = so.kvf_gemm_bf16.argtypes
        so.kvf_gemm_amx.restype = None
        so.kvf_prefill_attention.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                                             i64, ctypes.c_int]
        so.kvf_prefill_attention.restype = None
    so.kvf_decode_attention.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, ptr, i64,
                                        ctypes.c_int]
    so.kvf_decode_attention.restype = None
    so.kvf_add_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    so.kvf_add_rms_norm.restype = None
    so.kvf_rope_write.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ctypes.c_int]
    so.kvf_rope_write.restype = None
    so.kvf_silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, ctypes.c_int]
    so.kvf_silu_mul.restype = None
    return so


def available() -> bool:
    return _library() is not None


def flavour() -> str | None:
    """Which source the C kernels came from here: "avx512" (decode_gemm.c), "avx2" (decode_avx2.c) or None."""
    lib = _library()
    return lib.flavour if lib is not None else None


def library() -> ctypes.CDLL:
    """The C library itself, for callers that check their layouts once and then call its entry points many
    times with raw pointers (``Model``'s C forward): the checked wrappers here show each entry point's contract."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the C kernels are not available here")
    return lib


def blocks_supported() -> bool:
    """Whether ``gemm`` takes ``BlockWeight``s here (AMX tiles, or the AVX2 kernels)."""
    lib = _library()
    return lib is not None and lib.gemm_blocks is not None


class DecodeLayer(ctypes.Structure):
    """``decode_gemm.c: decode_layer``: one layer's ``DecodeBlocks`` and their formats, its norms, its pool layer."""

    _fields_ = ([(n, ctypes.c_void_p) for n in ("qkv", "o", "gate_up", "down")]
                + [(f"{n}_fmt", ctypes.c_int64) for n in ("qkv", "o", "gate_up", "down")]
                + [(n, ctypes.c_void_p) for n in ("attn_norm", "mlp_norm", "kv")])


class DecodeStep(ctypes.Structure):
    """``decode_gemm.c: decode_step``: a decode step's sizes, thread counts, buffers, rotary tables and slots."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("T", "H", "KV", "D", "hidden", "F2", "slot_stride", "threads", "light")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(n, ctypes.c_void_p) for n in ("x", "h", "proj", "qkv", "attn", "gate_up", "act", "cos", "sin",
                                                  "write", "read", "starts")])


def decode_blocks_supported() -> bool:
    """Whether ``gemm`` takes ``DecodeBlocks`` here (AVX512-VNNI and AMX int8)."""
    lib = _library()
    return lib is not None and lib.q8


GemmEntry = tuple[Callable[..., None], int, int]


def gemm_entry(w: torch.Tensor | BlockWeight | DecodeBlocks, amx: bool | None = None) -> GemmEntry:
    """``(fn, w_ptr, arg)`` such that ``fn(x_ptr, ldx, w_ptr, arg, y_ptr, ldy, M, N, K, threads)`` computes
    ``gemm(x, w)`` into y (bf16 rows of unit column stride, y's rows of stride ldy); w is checked here, once.
    ``w`` must outlive the entry."""
    lib = _library()
    N, K = w.shape
    if isinstance(w, DecodeBlocks):
        if not lib.q8:
            raise ValueError("DecodeBlocks need AVX512-VNNI and AMX int8")
        return lib.kvf_gemm_q8, w.data_ptr(), _FORMAT_IDS[w.fmt]
    if isinstance(w, BlockWeight):
        if lib.gemm_blocks is None or (lib.amx and N % 16):
            raise ValueError("block weights need AMX (with N % 16 == 0) or the AVX2 kernels")
        return lib.gemm_blocks, w.data_ptr(), _FORMAT_IDS[w.fmt]
    if w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise ValueError("decode gemm: w must be contiguous bfloat16")
    fn = lib.kvf_gemm_amx if (lib.amx if amx is None else amx) and K % 32 == 0 and N % 16 == 0 else lib.kvf_gemm_bf16
    return fn, w.data_ptr(), K


def gemm(x: torch.Tensor, w: torch.Tensor | BlockWeight | DecodeBlocks, amx: bool | None = None) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T -> [M, N]`` in bfloat16 on CPU; rows of x may have any row stride. ``w`` may be a
    ``BlockWeight`` (where ``blocks_supported()``): the same bits as its bf16 dequantization gives; or
    ``DecodeBlocks`` (where ``decode_blocks_supported()``): x quantized to int8 per block (``decode_gemm.c``)."""
    M, K = x.shape
    N = w.shape[0]
    if x.dtype != torch.bfloat16 or x.stride(1) != 1 or w.shape[1] != K:
        raise ValueError(f"decode gemm: bf16 x with unit column stride needed, got {x.dtype} {tuple(x.shape)} "
                         f"x {tuple(w.shape)}")
    fn, w_ptr, arg = gemm_entry(w, amx)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    fn(x.data_ptr(), x.stride(0), w_ptr, arg, out.data_ptr(), out.stride(0), M, N, K, threads())
    return out


def expand_rows(w: BlockWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64) of w as bf16 ``[len(rows), K]``: the embedding's gather from a block weight."""
    rows = rows.to(torch.int64).contiguous()
    if not w.rows.is_contiguous():
        raise ValueError("expand_rows: contiguous blocks needed")
    if len(rows) and not (0 <= int(rows.min()) and int(rows.max()) < w.shape[0]):  # C reads what it is told
        raise IndexError(f"expand_rows: row ids must lie in [0, {w.shape[0]})")
    out = torch.empty(len(rows), w.shape[1], dtype=torch.bfloat16)
    _library().kvf_expand_rows(w.data_ptr(), _FORMAT_IDS[w.fmt], rows.data_ptr(), len(rows), w.shape[1],
                               out.data_ptr())
    return out


def attention_fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether ``decode_attention`` and ``rope_write`` handle this head layout."""
    return head_dim % 16 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16


def decode_attention(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Attention of n single-token queries over their own sequences, reading K/V straight from the pool.

    q ``[n, H, D]`` (any row stride), kv ``[num_slots, 2, KV, D]`` (a pool layer, any slot stride), sequence i's
    positions at ``slots[starts[i] : starts[i + 1]]`` (int64), out ``[n, H D]`` (any row stride); bfloat16.
    """
    n, H, D = q.shape
    KV = kv.shape[2]
    if not (q.dtype == kv.dtype == out.dtype == torch.bfloat16 and attention_fits(H, KV, D)):
        raise ValueError("decode attention: bfloat16 only, and head_dim % 16 == 0")
    if q.stride()[1:] != (D, 1) or kv.stride()[1:] != (KV * D, D, 1) or out.stride(1) != 1 or out.shape != (n, H * D):
        raise ValueError("decode attention: bad layout")
    if not all(t.dtype == torch.int64 and t.is_contiguous() for t in (slots, starts)):
        raise ValueError("decode attention: slots and starts must be contiguous int64")
    _library().kvf_decode_attention(
        q.data_ptr(), q.stride(0), kv.data_ptr(), kv.stride(0), slots.data_ptr(), starts.data_ptr(), n, H, KV, D,
        D**-0.5, out.data_ptr(), out.stride(0), threads(),
    )
    return out


def prefill_attention_fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether ``prefill_attention`` handles this head layout here (it needs AMX tiles)."""
    lib = _library()
    return lib is not None and lib.amx and head_dim in (32, 64) and num_heads % num_kv_heads == 0


def prefill_attention(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of one chunk: n queries at positions S - n .. S - 1 over the sequence's S positions, whose
    K/V sit in pool slots ``slots`` ``[S]`` (int64) of kv ``[num_slots, 2, KV, D]`` (a pool layer). q ``[n, H, D]``
    (any row stride), out ``[n, H D]`` (any row stride); bfloat16. Each query head is computed alone, the same way
    on any thread count."""
    n, H, D = q.shape
    KV, S = kv.shape[2], slots.shape[0]
    if not (q.dtype == kv.dtype == out.dtype == torch.bfloat16 and prefill_attention_fits(H, KV, D)):
        raise ValueError("prefill attention: bfloat16, head_dim 32 or 64, and AMX needed")
    if q.stride()[1:] != (D, 1) or kv.stride()[1:] != (KV * D, D, 1) or out.stride(1) != 1 or out.shape != (n, H * D):
        raise ValueError("prefill attention: bad layout")
    if slots.dtype != torch.int64 or not slots.is_contiguous() or not 0 < n <= S:
        raise ValueError("prefill attention: slots must be contiguous int64, at least one per query")
    _library().kvf_prefill_attention(
        q.data_ptr(), q.stride(0), kv.data_ptr(), kv.stride(0), slots.data_ptr(), n, S, H, KV, D, D**-0.5,
        out.data_ptr(), out.stride(0), threads(),
    )
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += y`` (in place, when y is given), then HF RMSNorm of x times w -> a new ``[T, N]``; bfloat16, rows of
    unit stride. Row by row, in the same order for every row."""
    T, N = x.shape
    if x.stride(1) != 1 or (y is not None and (y.stride(1) != 1 or y.shape != x.shape)) or not w.is_contiguous():
        raise ValueError("add_rms_norm: bad layout")
    if not (x.dtype == w.dtype == torch.bfloat16 and (y is None or y.dtype == torch.bfloat16)):
        raise TypeError("add_rms_norm is bfloat16 only")
    h = torch.empty(T, N, dtype=torch.bfloat16)
    _library().kvf_add_rms_norm(
        x.data_ptr(), x.stride(0), None if y is None else y.data_ptr(), 0 if y is None else y.stride(0),
        w.data_ptr(), h.data_ptr(), N, T, N, eps, threads(),
    )
    return h


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotary embedding in place on the query and key heads of qkv ``[T, H + 2 KV, D]`` (HF rotate_half; ``sin``
    with its sign folded in, both ``[T, D]``), then each row's K/V into pool slot ``slots[t]`` of kv
    ``[num_slots, 2, KV, D]`` (a pool layer). Bit for bit what the torch ops in ``llama.py`` compute."""
    T, heads, D = qkv.shape
    KV = kv.shape[2]
    if qkv.stride()[1:] != (D, 1) or kv.stride()[1:] != (KV * D, D, 1) or D > 512:
        raise ValueError("rope_write: bad layout")
    if not (qkv.dtype == kv.dtype == cos.dtype == sin.dtype == torch.bfloat16) or not cos.is_contiguous():
        raise ValueError("rope_write: bfloat16 and contiguous tables only")
    if cos.shape != (T, D) or sin.shape != (T, D) or slots.shape != (T,) or slots.dtype != torch.int64:
        raise ValueError("rope_write: bad shapes")
    if not (sin.is_contiguous() and slots.is_contiguous()):
        raise ValueError("rope_write: tables and slots must be contiguous")
    _library().kvf_rope_write(
        qkv.data_ptr(), qkv.stride(0), heads - 2 * KV, KV, D, cos.data_ptr(), sin.data_ptr(), T, kv.data_ptr(),
        kv.stride(0), slots.data_ptr(), threads(),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for gate_up ``[T, 2 F]`` (gate first) -> ``[T, F]``; bfloat16, row by row, rounded as
    torch rounds it (silu to bf16, then the product)."""
    T, F2 = gate_up.shape
    if gate_up.dtype != torch.bfloat16 or gate_up.stride(1) != 1 or F2 % 2:
        raise ValueError("silu_mul: bfloat16 [T, 2 F] with unit column stride needed")
    out = torch.empty(T, F2 // 2, dtype=torch.bfloat16)
    _library().kvf_silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), T, F2 // 2,
                            threads())
    return out
