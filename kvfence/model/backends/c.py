"""The forward on the C kernels (bf16 on CPU): ``c-amx``, ``c-avx512`` or ``c-avx2``, the flavour
``kernels.detect()`` reports.

Every matmul row (prefill and decode) runs in a C kernel of that flavour: AMX tiles or AVX-512/AVX2 vectors, GGUF
blocks expanded to bf16 inside it, or multiplied in int8 against x quantized per block (``DecodeBlocks``: decode
rows, and every row where there are no tiles). The flavours differ by capability, not by code: which entry point a
weight gets is ``kernels.gemm_entry``'s choice, made once per weight. Attention reads K/V straight from the pool
(decode rows in one call; each prefill chunk in C where its head size fits, else torch's SDPA), and residual add +
RMSNorm, rotary + K/V write and silu(gate) * up are one call each. Each computes a row (or a sequence and head)
with the same instructions whatever else is in the call or how many threads run it, so they are batch-invariant by
construction and need no calibration. A step allocates its buffers once and calls the C entry points straight,
about ten per layer; a step of decode rows only runs all its layers in one call (``kvf_decode_layers``). See
docs/performance.md.

This module and ``kernels.py`` are where raw pointers live: the weights (and the decode copies kept here) are
never replaced after construction, since the entries hold their addresses.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import time
from typing import TypeGuard

import torch

from kvfence import env
from kvfence.config import ModelConfig
from kvfence.model import kernels
from kvfence.model.backends.torch import chunk_attention, qkv_extras
from kvfence.model.batch import Batch
from kvfence.model.blocks import INT8_FORMATS, BlockWeight, DecodeBlocks
from kvfence.model.memory import huge_pages, release_free_memory
from kvfence.model.weights import Matrix, Weights

log = logging.getLogger(__name__)

Entries = tuple[kernels.GemmEntry, kernels.GemmEntry]  # (longer chunks' entry, decode rows' entry) of one weight


def _int8(w: object) -> TypeGuard[BlockWeight]:
    """Whether w is a block weight of a format the int8 kernel takes (``DecodeBlocks``: Q4_1, Q8_0)."""
    return isinstance(w, BlockWeight) and w.fmt in INT8_FORMATS


def _regrouped(weights: Weights) -> dict[int, DecodeBlocks]:
    """The ``DecodeBlocks`` copy of each int8-format block weight of the layers and the head, by ``id`` of the
    weight, laid end to end in one buffer on huge pages (``memory.huge_pages``) in the order a decode step reads
    them: layer by layer (qkv, o, gate_up, down), then the head. In process on the EPYC host (2026-12-07) that
    made batch-1 decode 1.03x faster than separate tensors, 1.10x than the same buffer on 4 KiB pages."""
    todo = {id(w): w for w in [*(w for layer in weights.layers for w in layer.matrices), weights.lm_head] if _int8(w)}
    if not todo:
        return {}
    sizes = [DecodeBlocks.nbytes_of(w) for w in todo.values()]  # multiples of 64 (GROUP_BLOCK_BYTES are)
    starts = list(itertools.accumulate(sizes, initial=0))  # so every copy is 64-byte aligned, as the kernels load
    buffer = torch.frombuffer(huge_pages(starts[-1]), dtype=torch.uint8)
    return {key: DecodeBlocks.from_blocks(w, buffer[start : start + n])
            for (key, w), start, n in zip(todo.items(), starts[:-1], sizes, strict=True)}


class CBackend:
    """The forward of ``weights`` on the C kernels; the model's heads must fit them (``kernels.attention_fits``)."""

    def __init__(self, config: ModelConfig, weights: Weights, caps: kernels.Capabilities) -> None:
        self.config, self.weights = config, weights
        self.name = f"c-{caps.flavour}"
        # prefill chunks' attention in C (else torch's SDPA); KVFENCE_PREFILL_ATTENTION=0 turns it off
        self.prefill_attn = (env.prefill_attention()
                             and kernels.prefill_attention_fits(config.num_heads, config.num_kv_heads, config.head_dim))
        # one-token chunks (decode rows) multiply block weights in int8 where that kernel runs (``DecodeBlocks``:
        # a copy of the blocks regrouped for it, ``prepare_decode_rows``), and so do longer chunks where no AMX
        # tiles make the bf16 expansion cheaper (``int8_chunks``); KVFENCE_DECODE_INT8=0 keeps all rows on the
        # bf16 expansion. Only Q4_1/Q8_0 blocks have an int8 kernel: K-quant weights take the bf16 expansion always
        self.decode_int8 = (any(_int8(w) for w in weights.layers[0].matrices)
                            and caps.int8_rows and env.decode_int8())
        self.int8_chunks = self.decode_int8 and caps.int8_chunks
        if self.int8_chunks:  # every row of the block weights runs in int8: keep only their regrouped copies
            copies, tied = _regrouped(weights), weights.lm_head is weights.embed
            for layer in weights.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    setattr(layer, name, copies.get(id(w := getattr(layer, name)), w))
            weights.lm_head = copies.get(id(weights.lm_head), weights.lm_head)
            if tied:  # the embedding gathers from the head's copy (the same bits): the blocks go (30 MB for SmolLM2)
                weights.embed = weights.lm_head
        # per layer (qkv, o, gate_up, down) and for the head: the C matmul entries of each weight, checked once
        self._decode_weights: list[DecodeBlocks] = []
        self._gemm_entries = [tuple(map(self._entries, layer.matrices)) for layer in weights.layers]
        self._head_entries = self._entries(weights.lm_head)
        self._layer_args: tuple[int, ctypes.Array] | None = None  # (pool, kvf_decode_layers' layers): a cache

    @staticmethod
    def _entries(w: Matrix, decode_copy: DecodeBlocks | None = None) -> Entries:
        """``(longer chunks' entry, decode rows' entry)`` for weight w: the same entry twice unless decode rows
        multiply ``decode_copy`` (``prepare_decode_rows``)."""
        entry = kernels.gemm_entry(w)
        return entry, (entry if decode_copy is None else kernels.gemm_entry(decode_copy))

    def prepare_decode_rows(self) -> None:
        """Make the int8 copies decode rows (and ``int8_chunks``: every row) use (~1 s, ~100 MB for SmolLM2).
        Engines that decode call it at start; elsewhere (a prefill worker: its one-token chunks come only from
        prompts one past a multiple of the chunk size) the first step that needs them does. Idempotent; a no-op
        where decode rows use the weights themselves (or ``int8_chunks``: the copies replaced them at load)."""
        if not self.decode_int8 or self.int8_chunks or self._decode_weights:
            return
        t0 = time.perf_counter()
        copies = _regrouped(self.weights)
        self._decode_weights = list(copies.values())
        self._gemm_entries = [tuple(self._entries(w, copies.get(id(w))) for w in layer.matrices)
                              for layer in self.weights.layers]
        self._head_entries = self._entries(self.weights.lm_head, copies.get(id(self.weights.lm_head)))
        release_free_memory()  # the regrouping's temporaries
        log.info("int8 copies of the block weights for decode rows: %.0f MB in %.2fs",
                 sum(w.nbytes for w in self._decode_weights) / 1e6, time.perf_counter() - t0)

    def set_threads(self, n: int) -> None:
        """Compute on ``n`` threads: the C kernels and torch's own ops (the same bits on any count)."""
        kernels.set_threads(n)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def decode_weights(self) -> list[Matrix]:
        """Every weight a decode step reads in full: the ``DecodeBlocks`` copies where decode rows use them."""
        out = self.weights.read_in_full()
        if self._decode_weights:  # they replace the blocks they copy
            out = [t for t in out if not _int8(t)]
            out += self._decode_weights
        return out

    def forward(self, b: Batch, all_logits: bool) -> torch.Tensor:
        """``[T or B, vocab]`` bf16 logits of step ``b``, rows in processing order: per layer a fixed sequence of
        calls into ``kernels.library()`` on buffers allocated once per step, whose layouts hold by construction
        (bf16, rows of unit stride), so the checks of the wrappers in ``kernels.py`` run once per step instead of
        ~10 times per layer. The same calls in the same order as those wrappers make, so the same bits."""
        cfg, lib, th, layers = self.config, kernels.library(), kernels.threads(), self.weights.layers
        H, KV, D, hidden, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.rms_norm_eps
        T, d, width = len(b.tokens), b.decode_rows, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        if d:
            self.prepare_decode_rows()
        light = th if T >= 16 else 1  # threads of the element-wise kernels: a few rows cost less than a fork/join
        F2 = layers[0].matrices[2].shape[0]  # gate_up's rows
        x = self.weights.embed_rows(b.tokens)  # [T, hidden], a new tensor: the residual stream, updated in place
        h, proj = x.new_empty(T, hidden), x.new_empty(T, hidden)  # normed input of a projection; its output
        qkv, attn = x.new_empty(T, width), x.new_empty(T, H * D)
        gate_up, act = x.new_empty(T, F2), x.new_empty(T, F2 // 2)
        xp, hp, pp, qp, ap, gp, actp = (t.data_ptr() for t in (x, h, proj, qkv, attn, gate_up, act))
        cos, sin, write, read = b.cos.data_ptr(), b.sin.data_ptr(), b.write_slots.data_ptr(), b.read_slots.data_ptr()
        starts, scale = b.decode_starts.data_ptr(), D**-0.5
        chunks = [a for a in b.attn if not a.group]  # prefill chunks; decode rows [0, d) take one call
        lib.kvf_add_rms_norm(xp, hidden, None, 0, layers[0].attn_norm.data_ptr(), hp, hidden, T, hidden, eps, light)

        def matmul(entries: Entries, rows: int, xp: int, ldx: int, yp: int, N: int, K: int) -> None:
            """y [rows, N] = x [rows, K] (row stride ldx) @ w.T; rows [0, d) are decode rows."""
            (fn, w, arg), (decode_fn, decode_w, decode_arg) = entries
            if d and decode_fn is not fn:
                decode_fn(xp, ldx, decode_w, decode_arg, yp, N, d, N, K, th)
                if rows > d:
                    fn(xp + 2 * d * ldx, ldx, w, arg, yp + 2 * d * N, N, rows - d, N, K, th)
            else:
                fn(xp, ldx, w, arg, yp, N, rows, N, K, th)

        layer_args = self._decode_layer_args(b.kv_layers) if d == T else None
        if layer_args is not None:  # decode rows only: the same kernels in the same order, one call for all layers
            step = kernels.DecodeStep(T, H, KV, D, hidden, F2, b.kv_layers[0].stride(0), th, light, eps, scale, xp, hp,
                                      pp, qp, ap, gp, actp, cos, sin, write, read, starts)
            lib.kvf_decode_layers(ctypes.byref(step), layer_args, len(layers))
            x += proj
        steps = zip(layers, self._gemm_entries, strict=True) if layer_args is None else ()  # else: done
        for i, (layer, (qkv_mm, o_mm, gu_mm, dn_mm)) in enumerate(steps):
            kv = b.kv_layers[i]  # [num_slots, 2, KV, D], a view of the pool
            kvp, slot_stride = kv.data_ptr(), kv.stride(0)
            matmul(qkv_mm, T, hp, hidden, qp, width, hidden)
            if layer.qkv_bias is not None or layer.qk_norm is not None:
                qkv_extras(cfg, layer, qkv.view(T, -1, D))
            lib.kvf_rope_write(qp, width, H, KV, D, cos, sin, T, kvp, slot_stride, write, light)
            if d:
                lib.kvf_decode_attention(qp, width, kvp, slot_stride, read, starts, d, H, KV, D, scale, ap, H * D, th)
            for a in chunks:
                if self.prefill_attn:
                    lib.kvf_prefill_attention(qp + a.q0 * width * 2, width, kvp, slot_stride, read + a.k0 * 8,
                                              a.q1 - a.q0, a.k1 - a.k0, H, KV, D, scale, ap + a.q0 * H * D * 2,
                                              H * D, th)
                else:
                    q = qkv[a.q0 : a.q1].view(-1, width // D, D)[:, :H]
                    attn[a.q0 : a.q1] = chunk_attention(q, kv.index_select(0, b.read_slots[a.k0 : a.k1]), a)
            matmul(o_mm, T, ap, H * D, pp, hidden, H * D)
            lib.kvf_add_rms_norm(xp, hidden, pp, hidden, layer.mlp_norm.data_ptr(), hp, hidden, T, hidden, eps, light)
            matmul(gu_mm, T, hp, hidden, gp, F2, hidden)
            lib.kvf_silu_mul(gp, F2, actp, F2 // 2, T, F2 // 2, light)
            matmul(dn_mm, T, actp, F2 // 2, pp, hidden, F2 // 2)
            if i + 1 < len(layers):
                lib.kvf_add_rms_norm(xp, hidden, pp, hidden, layers[i + 1].attn_norm.data_ptr(), hp, hidden, T,
                                     hidden, eps, light)
            else:
                x += proj
        h = kernels.add_rms_norm(x if all_logits else x[b.last_rows], None, self.weights.norm, eps)  # [T or B, hidden]
        logits = h.new_empty(len(h), cfg.vocab_size)  # decode rows stay first: [0, d)
        matmul(self._head_entries, len(h), h.data_ptr(), hidden, logits.data_ptr(), cfg.vocab_size, hidden)
        return logits  # [T or B, vocab]

    def _decode_layer_args(self, kv_layers: tuple[torch.Tensor, ...]) -> ctypes.Array | None:
        """``kvf_decode_layers``'s per-layer arguments for this pool (cached); None where that loop does not apply:
        a weight without an int8 copy (decode rows not prepared, dense weights), or q/k/v extras."""
        key = kv_layers[0].data_ptr()
        if self._layer_args is not None and self._layer_args[0] == key:
            return self._layer_args[1]
        q8 = kernels.library().kvf_gemm_q8 if self.decode_int8 else None
        entries = [[decode for _, decode in layer] for layer in self._gemm_entries]
        layers = self.weights.layers
        if q8 is None or any(fn is not q8 for layer in entries for fn, _, _ in layer) or any(
                layer.qkv_bias is not None or layer.qk_norm is not None for layer in layers):
            return None
        args = (kernels.DecodeLayer * len(layers))()
        for a, layer, es, kv in zip(args, layers, entries, kv_layers, strict=True):
            (_, a.qkv, a.qkv_fmt), (_, a.o, a.o_fmt), (_, a.gate_up, a.gate_up_fmt), (_, a.down, a.down_fmt) = es
            a.attn_norm, a.mlp_norm, a.kv = layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr(), kv.data_ptr()
        self._layer_args = (key, args)
        return args
