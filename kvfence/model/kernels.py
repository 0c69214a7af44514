"""The C row kernels: built once per machine with the system C compiler, called via ctypes; ``detect()`` says
what this host runs (``Capabilities``).

``gemm(x, w)`` computes ``x @ w.T`` in bfloat16 with every row independent of the others by construction (see the
C files), so it needs no calibration; the model runs every matmul row through it, prefill and decode, with bf16
weights or GGUF blocks expanded on the fly (``BlockWeight``), except rows of block weights where an int8 kernel
runs: those multiply ``DecodeBlocks`` with x quantized to int8 per block, exact integer sums (decode rows, and on
CPUs without AMX prefill chunks too). Decode and prefill attention, add + RMSNorm, rotary + K/V write and the MLP's
silu(gate) * up are row- or sequence-wise the same way.

Three builds ("flavours"), one set of entry points, best first:
  amx     decode_gemm.c with AMX tiles (bf16 and int8 products, prefill attention on tiles) and AVX512-VNNI;
  avx512  decode_gemm.c without the tile instructions (AVX512-BF16, VNNI int8 on vectors, prefill attention with
          vdpbf16ps): AMD Zen 4 and later, Intel Cooper Lake;
  avx2    decode_avx2.c (AVX2, FMA, F16C; int8 with vpmaddubsw, the bits of the VNNI kernel).
The best flavour this CPU has and this compiler builds is used; one that does not build or load falls back to the
next. ``KVFENCE_CPU`` (read once) caps the choice: ``amx``, ``avx512``, ``avx2`` or ``none`` (no C kernels: the
model then runs on torch ops, ``backends/torch.py``), to run and test the paths of other CPUs on this one. Each
flavour is batch-invariant on its own terms; their bits differ. A process uses one of them throughout.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfence import env
from kvfence.cbuild import build
from kvfence.model.blocks import BlockWeight, DecodeBlocks

log = logging.getLogger(__name__)

_threads = 0  # threads of the C kernels; 0: torch's count
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c")
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c"]
# flavour: (source, CPU flags it needs, compiler flags), best first
_FLAVOURS = {
    "amx": ("decode_gemm.c", (*_AVX512, "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"),
            [*_AVX512_FLAGS, "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"]),
    "avx512": ("decode_gemm.c", _AVX512, _AVX512_FLAGS),  # + -mavx512vnni where the CPU has it
    "avx2": ("decode_avx2.c", ("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
}
OVERRIDES = ("auto", *_FLAVOURS, "none")  # KVFENCE_CPU's values
_FORMAT_IDS = {"Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}  # blocks.h's FMT_*
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_GEMM_ARGS = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int]  # x, ldx, w, ldw|fmt, y, ldy, M N K
_SIGNATURES = {  # every flavour's entry points (argtypes; all return void)
    "kvf_gemm_bf16": _GEMM_ARGS,
    "kvf_gemm_blocks": _GEMM_ARGS,
    "kvf_expand_rows": [_PTR, ctypes.c_int, _PTR, _I64, _I64, _PTR],
    "kvf_expand_group_rows": [_PTR, ctypes.c_int, _PTR, _I64, _I64, _PTR],
    "kvf_decode_attention": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _I64,
                             ctypes.c_int],
    "kvf_prefill_attention": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _I64,
                              ctypes.c_int],
    "kvf_add_rms_norm": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int],
    "kvf_rope_write": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, ctypes.c_int],
    "kvf_silu_mul": [_PTR, _I64, _PTR, _I64, _I64, _I64, ctypes.c_int],
}
_OPTIONAL = {  # entry points only some builds have
    "kvf_gemm_q8": _GEMM_ARGS,  # int8 rows: VNNI or AVX2 builds
    "kvf_decode_layers": [_PTR, _PTR, _I64],
    "kvf_gemm_amx": _GEMM_ARGS,  # the amx build
    "kvf_gemm_amx_blocks": _GEMM_ARGS,
}


@dataclass(frozen=True)
class Capabilities:
    """What the model's compute uses on this host: the C kernels' flavour and what it brings. ``forced``: the
    ``KVFENCE_CPU`` value that capped it, if any."""

    flavour: str | None  # "amx", "avx512", "avx2"; None: no C kernels (torch for everything)
    amx: bool  # AMX tiles: bf16 products of any size, int8 from 16 rows, prefill attention on tiles
    vnni: bool  # AVX512-VNNI int8 products
    avx2: bool  # the CPU has AVX2, FMA and F16C
    block_weights: bool  # GGUF Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights stay in their blocks (``gemm`` takes ``BlockWeight``)
    int8_rows: bool  # rows of Q4_1/Q8_0 block weights in int8 (``gemm`` takes ``DecodeBlocks``): decode rows
    int8_chunks: bool  # prefill chunks in int8 too (where no tiles make bf16 products cheaper)
    prefill_attention: bool  # a C kernel for prefill chunks' attention (head dims 32 and 64)
    forced: str | None = None

    def runs(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the C kernels compute a model of ``dtype`` on ``device``: bf16 on a CPU they built for."""
        return self.flavour is not None and dtype == torch.bfloat16 and device.type == "cpu"

    def summary(self) -> str:
        """One line for logs and health: ``flavour=avx512 amx=no vnni=yes ...``."""
        fields = {k: v for k, v in vars(self).items() if k != "forced"}
        text = " ".join(f"{k}={v if isinstance(v, str) or v is None else 'yes' if v else 'no'}"
                        for k, v in fields.items())
        return text + (f" (KVFENCE_CPU={self.forced})" if self.forced else "")


def set_threads(n: int) -> None:
    """Run the C kernels on ``n`` threads (0: torch's count). Their results do not depend on it: threads split
    the rows, sequences or columns, and each is computed by the same instructions whichever thread runs it."""
    global _threads
    _threads = n


def threads() -> int:
    """The thread count the C kernels run on now."""
    return _threads or torch.get_num_threads()


def release_thread_pool() -> None:
    """Release the calling thread's OpenMP worker threads (``omp_pause_resource_all``; torch and the C kernels
    share one libgomp), for a caller that loaded a model and hands it to another thread to run.

    Each thread that starts parallel regions keeps a pool of its own, and once libgomp manages more threads than
    there are CPUs it stops letting idle workers spin: every region of the thread that runs the model then waits
    for a sleeping worker to wake, ~50 us each (a batch-1 decode step 5-6x slower). Harmless where no libgomp is
    loaded or the runtime cannot pause (nothing to do)."""
    try:
        ctypes.CDLL("libgomp.so.1").omp_pause_resource_all(1)  # omp_pause_soft
    except (OSError, AttributeError):
        pass


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def _cpu_has(*features: str) -> bool:
    return set(features) <= _cpu_flags()


@functools.cache
def _override() -> str | None:
    """``KVFENCE_CPU``, checked (None when unset or "auto")."""
    value = env.cpu()
    if value not in OVERRIDES:
        raise ValueError(f"KVFENCE_CPU={value!r}: expected one of {', '.join(OVERRIDES)}")
    return None if value == "auto" else value


def _candidates() -> list[str]:
    """The flavours to try, best first: those this CPU runs, from the override's down."""
    forced = _override()
    names = list(_FLAVOURS)
    if forced == "none":
        return []
    if forced is not None:
        names = names[names.index(forced):]
    return [name for name in names if _cpu_has(*_FLAVOURS[name][1])]


class DecodeLayer(ctypes.Structure):
    """``decode_step.h: decode_layer``: one layer's ``DecodeBlocks`` and their formats, its norms, its pool layer."""

    _fields_ = ([(n, ctypes.c_void_p) for n in ("qkv", "o", "gate_up", "down")]
                + [(f"{n}_fmt", ctypes.c_int64) for n in ("qkv", "o", "gate_up", "down")]
                + [(n, ctypes.c_void_p) for n in ("attn_norm", "mlp_norm", "kv")])


class DecodeStep(ctypes.Structure):
    """``decode_step.h: decode_step``: a decode step's sizes, thread counts, buffers, rotary tables and slots."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("T", "H", "KV", "D", "hidden", "F2", "slot_stride", "threads", "light")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(n, ctypes.c_void_p) for n in ("x", "h", "proj", "qkv", "attn", "gate_up", "act", "cos", "sin",
                                                  "write", "read", "starts")])


def layout_mismatch(so: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]]) -> str | None:
    """How the ctypes ``structs`` (by C name) differ from what ``kvf_layout`` reports of the C ones: a field's
    offset or size or a struct's size, matched by name, and fields only one side has; None if they agree."""
    names = ctypes.c_char_p()
    values = (ctypes.c_int64 * so.kvf_layout(None, None))()
    so.kvf_layout(values, ctypes.byref(names))
    assert names.value is not None  # kvf_layout always names its fields
    listed = names.value.decode().split(",")
    fields, sizes = listed[:-2], listed[-2:]
    c_side: dict[str, tuple[int, ...]] = {name: tuple(values[2 * i : 2 * i + 2]) for i, name in enumerate(fields)}
    c_side |= {name: (values[2 * len(fields) + i],) for i, name in enumerate(sizes)}
    ours: dict[str, tuple[int, ...]] = {f"{s}.{f}": (getattr(st, f).offset, getattr(st, f).size)
                                        for s, st in structs.items() for f, *_ in st._fields_}
    ours |= {f"sizeof.{s}": (ctypes.sizeof(st),) for s, st in structs.items()}
    wrong = sorted(n for n in c_side.keys() | ours.keys() if c_side.get(n) != ours.get(n))
    return ", ".join(f"{n}: {c_side.get(n)} in C, {ours.get(n)} in ctypes" for n in wrong) or None


def _load(name: str) -> ctypes.CDLL | None:
    """Build and load flavour ``name``; None if it does not build or its tiles are refused (logged)."""
    file, _, flags = _FLAVOURS[name]
    if name == "avx512" and _cpu_has("avx512_vnni"):
        flags = [*flags, "-mavx512vnni"]
    source = Path(__file__).with_name(file)
    lib = build(source, [*flags, *_COMMON_FLAGS], deps=sorted(source.parent.glob("*.h")))
    if lib is None:
        return None
    so = ctypes.CDLL(str(lib))
    if name == "amx" and so.kvf_amx_init() != 1:
        log.warning("the kernel refused this process the AMX tiles: the %s kernels fall back", name)
        return None
    for fn, args in [*_SIGNATURES.items(), *((f, a) for f, a in _OPTIONAL.items() if hasattr(so, f))]:
        getattr(so, fn).argtypes, getattr(so, fn).restype = args, None
    so.kvf_layout.argtypes, so.kvf_layout.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int64
    problem = layout_mismatch(so, {"decode_layer": DecodeLayer, "decode_step": DecodeStep})
    if problem:
        raise RuntimeError(f"{source.name}: decode_step.h's structs differ from kernels.DecodeLayer/DecodeStep: "
                           f"{problem}")
    return so


@functools.cache
def _built() -> tuple[str | None, ctypes.CDLL | None]:
    for name in _candidates():
        so = _load(name)
        if so is not None:
            return name, so
    return None, None


@functools.cache
def detect() -> Capabilities:
    """This host's ``Capabilities`` (the C kernels are built on the first call)."""
    name, so = _built()
    amx = name == "amx"
    int8 = so is not None and hasattr(so, "kvf_gemm_q8")
    return Capabilities(
        flavour=name, amx=amx, vnni=int8 and name != "avx2", avx2=_cpu_has(*_FLAVOURS["avx2"][1]),
        block_weights=so is not None, int8_rows=int8, int8_chunks=int8 and not amx,
        prefill_attention=so is not None, forced=_override(),
    )


def library() -> ctypes.CDLL:
    """The C library itself, for callers that check their layouts once and then call its entry points many
    times with raw pointers (``backends/c.py``): the checked wrappers here show each entry point's contract."""
    lib = _built()[1]
    if lib is None:
        raise RuntimeError("the C kernels are not available here")
    return lib


GemmEntry = tuple[Callable[..., None], int, int]


def gemm_entry(w: torch.Tensor | BlockWeight | DecodeBlocks, amx: bool | None = None) -> GemmEntry:
    """``(fn, w_ptr, arg)`` such that ``fn(x_ptr, ldx, w_ptr, arg, y_ptr, ldy, M, N, K, threads)`` computes
    ``gemm(x, w)`` into y (bf16 rows of unit column stride, y's rows of stride ldy); w is checked here, once.
    ``amx``: the bf16 product on tiles (default: where there are tiles) or not. ``w`` must outlive the entry."""
    lib, caps = library(), detect()
    N, K = w.shape
    if isinstance(w, DecodeBlocks):
        if not caps.int8_rows:
            raise ValueError(f"DecodeBlocks need an int8 kernel (AVX512-VNNI or AVX2), not {caps.flavour}")
        return lib.kvf_gemm_q8, w.data_ptr(), _FORMAT_IDS[w.fmt]
    if isinstance(w, BlockWeight):
        if N % 16:
            raise ValueError("block weights need N % 16 == 0")
        return lib.kvf_gemm_amx_blocks if caps.amx else lib.kvf_gemm_blocks, w.data_ptr(), _FORMAT_IDS[w.fmt]
    if w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise ValueError("decode gemm: w must be contiguous bfloat16")
    tiles = caps.amx if amx is None else amx
    fn = lib.kvf_gemm_amx if tiles and caps.amx and K % 32 == 0 and N % 16 == 0 else lib.kvf_gemm_bf16
    return fn, w.data_ptr(), K


def gemm(x: torch.Tensor, w: torch.Tensor | BlockWeight | DecodeBlocks, amx: bool | None = None) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T -> [M, N]`` in bfloat16 on CPU; rows of x may have any row stride. ``w`` may be a
    ``BlockWeight`` (where ``detect().block_weights``): the same bits as its bf16 dequantization gives; or
    ``DecodeBlocks`` (where ``detect().int8_rows``): x quantized to int8 per block (``decode_gemm.c``)."""
    M, K = x.shape
    N = w.shape[0]
    if x.dtype != torch.bfloat16 or x.stride(1) != 1 or w.shape[1] != K:
        raise ValueError(f"decode gemm: bf16 x with unit column stride needed, got {x.dtype} {tuple(x.shape)} "
                         f"x {tuple(w.shape)}")
    fn, w_ptr, arg = gemm_entry(w, amx)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    fn(x.data_ptr(), x.stride(0), w_ptr, arg, out.data_ptr(), out.stride(0), M, N, K, threads())
    return out


def expand_rows(w: BlockWeight | DecodeBlocks, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64) of w as bf16 ``[len(rows), K]``: the embedding's gather from a block weight (or from
    its regrouped copy, where a tied head keeps only that: the same bits)."""
    rows = rows.to(torch.int64).contiguous()
    if not (w.data if isinstance(w, DecodeBlocks) else w.rows).is_contiguous():
        raise ValueError("expand_rows: contiguous blocks needed")
    if len(rows) and not (0 <= int(rows.min()) and int(rows.max()) < w.shape[0]):  # C reads what it is told
        raise IndexError(f"expand_rows: row ids must lie in [0, {w.shape[0]})")
    out = torch.empty(len(rows), w.shape[1], dtype=torch.bfloat16)
    gather = library().kvf_expand_group_rows if isinstance(w, DecodeBlocks) else library().kvf_expand_rows
    gather(w.data_ptr(), _FORMAT_IDS[w.fmt], rows.data_ptr(), len(rows), w.shape[1], out.data_ptr())
    return out


def attention_fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether ``decode_attention`` and ``rope_write`` handle this head layout."""
    return (head_dim % 16 == 0 and head_dim <= 256 and num_heads <= 256 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 16)


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
    library().kvf_decode_attention(
        q.data_ptr(), q.stride(0), kv.data_ptr(), kv.stride(0), slots.data_ptr(), starts.data_ptr(), n, H, KV, D,
        D**-0.5, out.data_ptr(), out.stride(0), threads(),
    )
    return out


def prefill_attention_fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether ``prefill_attention`` handles this head layout here (any flavour; head dims 32 and 64)."""
    return detect().prefill_attention and head_dim in (32, 64) and num_heads % num_kv_heads == 0


def prefill_attention(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of one chunk: n queries at positions S - n .. S - 1 over the sequence's S positions, whose
    K/V sit in pool slots ``slots`` ``[S]`` (int64) of kv ``[num_slots, 2, KV, D]`` (a pool layer). q ``[n, H, D]``
    (any row stride), out ``[n, H D]`` (any row stride); bfloat16. Each query head is computed alone, the same way
    on any thread count."""
    n, H, D = q.shape
    KV, S = kv.shape[2], slots.shape[0]
    if not (q.dtype == kv.dtype == out.dtype == torch.bfloat16 and prefill_attention_fits(H, KV, D)):
        raise ValueError("prefill attention: bfloat16, head_dim 32 or 64, and the C kernels needed")
    if q.stride()[1:] != (D, 1) or kv.stride()[1:] != (KV * D, D, 1) or out.stride(1) != 1 or out.shape != (n, H * D):
        raise ValueError("prefill attention: bad layout")
    if slots.dtype != torch.int64 or not slots.is_contiguous() or not 0 < n <= S:
        raise ValueError("prefill attention: slots must be contiguous int64, at least one per query")
    library().kvf_prefill_attention(
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
    library().kvf_add_rms_norm(
        x.data_ptr(), x.stride(0), None if y is None else y.data_ptr(), 0 if y is None else y.stride(0),
        w.data_ptr(), h.data_ptr(), N, T, N, eps, threads(),
    )
    return h


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotary embedding in place on the query and key heads of qkv ``[T, H + 2 KV, D]`` (HF rotate_half; ``sin``
    with its sign folded in, both ``[T, D]``), then each row's K/V into pool slot ``slots[t]`` of kv
    ``[num_slots, 2, KV, D]`` (a pool layer). Bit for bit what the torch ops in ``backends/torch.py`` compute."""
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
    library().kvf_rope_write(
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
    library().kvf_silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), T, F2 // 2,
                            threads())
    return out
