"""Llama-family forward (Llama, Qwen2, Qwen3) over the paged KV pool.

One ``forward`` runs a step for several sequences at once: every chunk's tokens are concatenated into ``[T, hidden]``
for the linear layers, each chunk's new K/V is written to its own slots, and attention runs over the positions
[0, start_pos + n) of each sequence only. Decode chunks (one token) whose sequences have the same length share one
attention call (a batch of sequences, no padding); longer chunks get a call each.

Batch invariance: a chunk's logits are bit-identical whatever other chunks share the call. Linear layers run row
by row in the C kernel (or, without it, in row blocks of calibrated sizes, ``invariant.py``), norms and activations
are row-wise, and attention never mixes sequences: a batched decode call computes each sequence as its own (batch,
head) problem, with the same shapes (one query per head, the same key length) as when that sequence is alone,
which the tests check bit for bit.
Nothing a row computes depends on its neighbours or its position in the batch, so the forward is free to reorder
chunks (decode groups first) and restores the caller's order in the logits.

Fast path (bf16 on CPU, when ``kernels.py`` builds its C library; ``_forward_c``): every matmul row (prefill and
decode) runs in a C kernel of the flavour ``kernels.detect()`` reports (AMX tiles, AVX-512 or AVX2 vectors; GGUF
blocks expanded to bf16 inside it, or multiplied in int8 against x quantized per block: decode rows, and every
row where there are no tiles), attention reads K/V straight from the pool (decode rows in one call; each prefill
chunk in C where its head size fits, else torch's SDPA), and residual add + RMSNorm, rotary + K/V write and
silu(gate) * up are one call each. Each of these computes a row (or a sequence and head) with the same
instructions whatever else is in the call or how many threads run it, so they are batch-invariant by
construction and need no calibration. A step allocates its buffers once and calls the C entry points straight,
about ten per layer. See docs/performance.md.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from kvfence.config import ModelConfig
from kvfence.kvcache.pool import KVPool
from kvfence.model import invariant, kernels
from kvfence.model.blocks import BlockWeight, DecodeBlocks

log = logging.getLogger(__name__)


@dataclass
class SeqChunk:
    token_ids: list[int]  # tokens to compute now (a prefill chunk, or 1 token for decode)
    start_pos: int  # position of token_ids[0] in the sequence
    page_ids: list[int]  # all pages of this sequence, covering positions [0, start_pos + len(token_ids))


@dataclass
class Layer:
    """One decoder block's weights, fused: qkv ``[(H + 2 KV) D, hidden]``, gate_up ``[2 F, hidden]``. A matmul
    weight may be a ``BlockWeight`` (GGUF blocks the kernel expands) or ``DecodeBlocks`` (the same blocks regrouped
    for the int8 kernel, where every row runs in int8: ``Model.int8_chunks``)."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor | BlockWeight | DecodeBlocks
    qkv_bias: torch.Tensor | None  # [(H + 2 KV) D] (qwen2)
    qk_norm: torch.Tensor | None  # [H + KV, D]: q_norm repeated H times, then k_norm KV times (qwen3)
    o: torch.Tensor | BlockWeight | DecodeBlocks  # [hidden, H D]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | BlockWeight | DecodeBlocks
    down: torch.Tensor | BlockWeight | DecodeBlocks  # [hidden, F]


@dataclass
class _Attn:
    """One attention call: batch rows [q0, q1) attend over rows [k0, k1) of the gathered K/V.

    ``group`` > 0: a decode group, ``group`` sequences of one query each and the same length ``(k1 - k0) / group``.
    Otherwise one chunk of ``q1 - q0`` queries of one sequence whose positions [0, start_pos + n) are [k0, k1).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    group: int
    mask: torch.Tensor | None  # [n, S] bool, bottom-right causal; None when causal or a single query
    causal: bool


@dataclass
class _Batch:
    """Per-forward index tensors, built once and reused by every layer. Rows are in processing order (decode
    groups first); ``out_rows`` picks the logits rows in the caller's order."""

    tokens: torch.Tensor  # [T]
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D], sign of the first half flipped (rotate_half folded in)
    kv_layers: tuple[torch.Tensor, ...]  # per layer [num_slots, 2, KV, D]: views of the pool, slot by slot
    write_slots: torch.Tensor  # [T] pool slots of the new tokens
    read_slots: torch.Tensor  # [S_total] pool slots of every sequence's positions, sequence after sequence
    attn: list[_Attn]
    decode_rows: int  # rows [0, decode_rows) are decode chunks (one token each), and so are the first logits rows
    decode_kv: int  # read_slots[:decode_kv] are the decode chunks' sequences
    decode_starts: torch.Tensor  # [decode_rows + 1] where each decode chunk's sequence starts in read_slots
    last_rows: torch.Tensor  # [B] row of each chunk's last token, in processing order
    chunk_order: torch.Tensor | None  # [B] logits rows (of last_rows) in the caller's order; None: the same
    token_order: torch.Tensor | None  # [T] logits rows (of all rows) in the caller's order; None: the same


class Model:
    """Hand-written decoder; weights are fused and cast at load (``from_state_dict``)."""

    def __init__(
        self, config: ModelConfig, embed: torch.Tensor | BlockWeight, layers: list[Layer], norm: torch.Tensor,
        lm_head: torch.Tensor | BlockWeight,
    ):
        self.config = config
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.dtype, self.device = norm.dtype, norm.device
        self.cos, self.sin = _rope_tables(config, self.dtype, self.device)  # [max_context, D] each
        self._blocks: dict[tuple[int, ...], invariant.RowBlocks] = {}
        self._head_blocks: invariant.RowBlocks | None = None
        self._threads = -1
        self._pool_views: tuple[tuple, tuple[torch.Tensor, ...]] | None = None
        # every matmul through the C kernel (bf16 on CPU, when it builds here); False: calibrated torch row blocks
        caps = kernels.detect()
        self.c_gemm = self.dtype == torch.bfloat16 and self.device.type == "cpu" and caps.flavour is not None
        self.decode_attn = self.c_gemm and kernels.attention_fits(config.num_heads, config.num_kv_heads,
                                                                  config.head_dim)
        # prefill chunks' attention in C (else torch's SDPA); KVFENCE_PREFILL_ATTENTION=0 turns it off
        self.prefill_attn = (self.decode_attn and os.environ.get("KVFENCE_PREFILL_ATTENTION", "1") != "0"
                             and kernels.prefill_attention_fits(config.num_heads, config.num_kv_heads, config.head_dim))
        if not self.c_gemm:
            self.calibrate()
        # on a GPU, one attention call per group of same-length decode rows where a backend proves batch-invariant
        self.decode_backend = (invariant.decode_attention_backend(
            config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim, self.dtype,
            str(self.device)) if self.device.type == "cuda" else None)
        # one-token chunks (decode rows) multiply block weights in int8 where that kernel runs (``DecodeBlocks``:
        # a copy of the blocks regrouped for it, ``prepare_decode_rows``), and so do longer chunks where no AMX
        # tiles make the bf16 expansion cheaper (``int8_chunks``); KVFENCE_DECODE_INT8=0 keeps all rows on the
        # bf16 expansion
        self.decode_int8 = (self.decode_attn and any(isinstance(w, BlockWeight) for w in vars(layers[0]).values())
                            and caps.int8_rows and os.environ.get("KVFENCE_DECODE_INT8", "1") != "0")
        self.int8_chunks = self.decode_int8 and caps.int8_chunks
        if self.int8_chunks:  # every row of the block weights runs in int8: keep only their regrouped copies
            for layer in layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    if isinstance(w := getattr(layer, name), BlockWeight):
                        setattr(layer, name, DecodeBlocks.from_blocks(w))
            if isinstance(lm_head, BlockWeight):  # the embedding keeps the blocks for its gather
                self.lm_head = lm_head = DecodeBlocks.from_blocks(lm_head)
        # per layer (qkv, o, gate_up, down) and for the head: the C matmul entries of each weight for longer chunks
        # and for decode rows, checked once (``_forward_c``); they hold raw pointers, so the weights (and the
        # decode copies kept here) are never replaced after construction
        self._decode_weights: list[DecodeBlocks] = []
        self._gemm_entries = [tuple(self._entries(w) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
                              for layer in layers] if self.decode_attn else []
        self._head_entries = self._entries(lm_head) if self.decode_attn else None
        self._layer_args: tuple[int, ctypes.Array] | None = None  # (pool, kvf_decode_layers' layers): a cache

    def _entries(self, w: torch.Tensor | BlockWeight | DecodeBlocks, decode_copy: bool = False
                 ) -> tuple[kernels.GemmEntry, kernels.GemmEntry]:
        """``(longer chunks' entry, decode rows' entry)`` for weight w; the same entry twice until
        ``prepare_decode_rows`` makes the copy (``decode_copy``)."""
        entry = kernels.gemm_entry(w)
        if not (decode_copy and self.decode_int8 and isinstance(w, BlockWeight)):
            return entry, entry
        self._decode_weights.append(DecodeBlocks.from_blocks(w))
        return entry, kernels.gemm_entry(self._decode_weights[-1])

    def prepare_decode_rows(self) -> None:
        """Make the int8 copies decode rows (and ``int8_chunks``: every row) use (~1 s, ~100 MB for SmolLM2).
        Engines that decode call it at start; elsewhere (a prefill worker: its one-token chunks come only from
        prompts one past a multiple of the chunk size) the first step that needs them does. Idempotent; a no-op
        where decode rows use the weights themselves (or ``int8_chunks``: the copies replaced them at load)."""
        if not self.decode_int8 or self.int8_chunks or self._decode_weights:
            return
        t0 = time.perf_counter()
        self._gemm_entries = [tuple(self._entries(w, True) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
                              for layer in self.layers]
        self._head_entries = self._entries(self.lm_head, True)
        from kvfence.model.loader import release_free_memory  # here: loader imports this module

        release_free_memory()  # the regrouping's temporaries
        log.info("int8 copies of the block weights for decode rows: %.0f MB in %.2fs",
                 sum(w.nbytes for w in self._decode_weights) / 1e6, time.perf_counter() - t0)

    @classmethod
    def from_state_dict(
        cls, cfg: ModelConfig, sd: dict[str, torch.Tensor | BlockWeight], dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
    ) -> Model:
        """Build from HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...), fusing q/k/v and gate/up.

        GGUF block weights stay blocks wherever the C kernels run (bf16, unless
        ``KVFENCE_KEEP_BLOCKS=0``): the same bits as dequantized weights, a third of the bytes. Elsewhere they are
        dequantized here."""
        keep = (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and kernels.detect().block_weights
                and os.environ.get("KVFENCE_KEEP_BLOCKS", "1") != "0")

        def get(name: str) -> torch.Tensor | BlockWeight:
            w = sd[name]
            if isinstance(w, BlockWeight):
                if keep and w.shape[0] % 16 == 0:
                    return w
                w = w.dequantize()
            return w.to(device=device, dtype=dtype).contiguous()

        layers = [_layer(cfg, get, f"model.layers.{i}.", sd) for i in range(cfg.num_layers)]
        embed = get("model.embed_tokens.weight")
        lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
        return cls(cfg, embed, layers, get("model.norm.weight"), lm_head)

    def parameters_for_bandwidth(self) -> list[torch.Tensor | BlockWeight | DecodeBlocks]:
        """Every weight a decode step reads in full (the embedding is only gathered from, unless tied): the
        ``DecodeBlocks`` copies where decode rows use them."""
        out = [self.norm, self.lm_head]
        for layer in self.layers:
            out += [t for t in vars(layer).values() if t is not None]
        if self._decode_weights:  # they replace the blocks they copy
            out = [t for t in out if not isinstance(t, BlockWeight)] + self._decode_weights
        return out

    # -- batch invariance -------------------------------------------------------------------------------------

    def calibrate(self) -> None:
        """Measure the batch-invariant row blocks of every weight shape for the current thread count."""
        t0, self._threads = time.perf_counter(), torch.get_num_threads()
        first = self.layers[0]
        for w in (first.qkv, first.o, first.gate_up, first.down):
            self._blocks[tuple(w.shape)] = invariant.calibrate(*w.shape, w.dtype, str(w.device), self._threads)
        head = self.lm_head  # sees one row per chunk: no large call sizes (checking them would cost seconds)
        self._head_blocks = invariant.calibrate(*head.shape, head.dtype, str(head.device), self._threads, big=False)
        log.info(
            "calibrated batch-invariant matmuls (%s, %d threads) in %.2fs",
            self.dtype,
            self._threads,
            time.perf_counter() - t0,
        )

    def _linear(self, x: torch.Tensor, w: torch.Tensor, blocks=None) -> torch.Tensor:
        """``x [T, K] @ w.T`` -> ``[T, N]``, a new tensor; no row depends on the others. The C kernel computes each
        row alone by construction (and beats the calibrated torch blocks at prefill sizes: 204 rows 2.2x on one
        thread, 512 rows 1.3x); without it, calibrated row blocks."""
        if self.c_gemm:
            return kernels.gemm(x, w)
        return invariant.matmul(x, w, blocks or self._blocks[tuple(w.shape)])

    # -- forward ----------------------------------------------------------------------------------------------

    def forward(self, chunks: list[SeqChunk], pool: KVPool, all_logits: bool = False) -> torch.Tensor:
        """Run one step: for each chunk write its K/V into the pool at its slots and attend over positions
        [0, start_pos + n) of its own sequence (causal).

        Returns float32 logits: ``[len(chunks), vocab]`` for each chunk's last token, or ``[sum(n), vocab]`` for
        every token when ``all_logits``. Each row is bit-identical whatever other chunks share the call.
        """
        if not self.c_gemm and torch.get_num_threads() != self._threads:
            self.calibrate()
        with torch.inference_mode():
            b = self._batch(chunks, pool)
            if self.decode_attn:
                logits = self._forward_c(b, all_logits)
            else:
                x = self._embed(b.tokens)  # [T, hidden], a new tensor: updated in place below
                for i, layer in enumerate(self.layers):
                    x += self._attention(layer, self._rms_norm(x, layer.attn_norm), b, b.kv_layers[i])
                    x += self._mlp(layer, self._rms_norm(x, layer.mlp_norm))
                h = self._rms_norm(x if all_logits else x[b.last_rows], self.norm)  # [T or B, hidden]
                logits = self._linear(h, self.lm_head, blocks=self._head_blocks)  # [T or B, vocab]
            order = b.token_order if all_logits else b.chunk_order
            return (logits if order is None else logits[order]).float()

    __call__ = forward

    def _attention(self, layer: Layer, x: torch.Tensor, b: _Batch, slots: torch.Tensor) -> torch.Tensor:
        cfg, T = self.config, x.shape[0]
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self._linear(x, layer.qkv).view(T, H + 2 * KV, D)  # [T, H + 2 KV, D]
        self._qkv_extras(layer, qkv)
        qk = qkv[:, : H + KV]  # [T, H + KV, D], a view of qkv
        rot = qk.roll(D // 2, dims=-1).mul_(b.sin)  # rotary, HF rotate_half convention, in place in qkv
        qk.mul_(b.cos).add_(rot)
        slots.index_copy_(0, b.write_slots, qkv[:, H:].view(T, 2, KV, D))  # new tokens' K/V into their slots
        q = qkv[:, :H]  # [T, H, D]
        kv = slots.index_select(0, b.read_slots)  # [S_total, 2, KV, D]
        if len(b.attn) == 1 and b.attn[0].group:  # all decode, one length: the output is the attention result
            return self._linear(self._decode_attention(q, kv, b.attn[0]), layer.o)  # [T, hidden]
        out = x.new_empty(T, H * D)
        for a in b.attn:
            if a.group:
                out[a.q0 : a.q1] = self._decode_attention(q[a.q0 : a.q1], kv[a.k0 : a.k1], a)
            else:
                out[a.q0 : a.q1] = self._chunk_attention(q[a.q0 : a.q1], kv[a.k0 : a.k1], a)
        return self._linear(out, layer.o)  # [T, hidden]

    def _forward_c(self, b: _Batch, all_logits: bool) -> torch.Tensor:
        """The forward on the C kernels: per layer a fixed sequence of calls into ``kernels.library()`` on buffers
        allocated once per step, whose layouts hold by construction (bf16, rows of unit stride), so the checks of
        the wrappers in ``kernels.py`` run once per step instead of ~10 times per layer. The same calls in the
        same order as those wrappers make, so the same bits. Returns ``[T or B, vocab]`` logits, processing order.
        """
        cfg, lib, th = self.config, kernels.library(), kernels.threads()
        H, KV, D, hidden, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.rms_norm_eps
        T, d, width = len(b.tokens), b.decode_rows, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        if d:
            self.prepare_decode_rows()
        light = th if T >= 16 else 1  # threads of the element-wise kernels: a few rows cost less than a fork/join
        F2 = self.layers[0].gate_up.shape[0]
        x = self._embed(b.tokens)  # [T, hidden], a new tensor: the residual stream, updated in place
        h, proj = x.new_empty(T, hidden), x.new_empty(T, hidden)  # normed input of a projection; its output
        qkv, attn = x.new_empty(T, width), x.new_empty(T, H * D)
        gate_up, act = x.new_empty(T, F2), x.new_empty(T, F2 // 2)
        xp, hp, pp, qp, ap, gp, actp = (t.data_ptr() for t in (x, h, proj, qkv, attn, gate_up, act))
        cos, sin, write, read = b.cos.data_ptr(), b.sin.data_ptr(), b.write_slots.data_ptr(), b.read_slots.data_ptr()
        starts, scale = b.decode_starts.data_ptr(), D**-0.5
        chunks = [a for a in b.attn if not a.group]  # prefill chunks; decode rows [0, d) take one call
        lib.kvf_add_rms_norm(xp, hidden, None, 0, self.layers[0].attn_norm.data_ptr(), hp, hidden, T, hidden, eps,
                             light)

        def matmul(entries: tuple[kernels.GemmEntry, kernels.GemmEntry], rows: int, xp: int, ldx: int, yp: int,
                   N: int, K: int) -> None:  # y [rows, N] = x [rows, K] (row stride ldx) @ w.T; rows [0, d) decode
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
            lib.kvf_decode_layers(ctypes.byref(step), layer_args, len(self.layers))
            x += proj
        layers = zip(self.layers, self._gemm_entries, strict=True) if layer_args is None else ()  # else: done
        for i, (layer, (qkv_mm, o_mm, gu_mm, dn_mm)) in enumerate(layers):
            kv = b.kv_layers[i]  # [num_slots, 2, KV, D], a view of the pool
            kvp, slot_stride = kv.data_ptr(), kv.stride(0)
            matmul(qkv_mm, T, hp, hidden, qp, width, hidden)
            if layer.qkv_bias is not None or layer.qk_norm is not None:
                self._qkv_extras(layer, qkv.view(T, -1, D))
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
                    attn[a.q0 : a.q1] = self._chunk_attention(q, kv.index_select(0, b.read_slots[a.k0 : a.k1]), a)
            matmul(o_mm, T, ap, H * D, pp, hidden, H * D)
            lib.kvf_add_rms_norm(xp, hidden, pp, hidden, layer.mlp_norm.data_ptr(), hp, hidden, T, hidden, eps, light)
            matmul(gu_mm, T, hp, hidden, gp, F2, hidden)
            lib.kvf_silu_mul(gp, F2, actp, F2 // 2, T, F2 // 2, light)
            matmul(dn_mm, T, actp, F2 // 2, pp, hidden, F2 // 2)
            if i + 1 < len(self.layers):
                lib.kvf_add_rms_norm(xp, hidden, pp, hidden, self.layers[i + 1].attn_norm.data_ptr(), hp, hidden, T,
                                     hidden, eps, light)
            else:
                x += proj
        h = kernels.add_rms_norm(x if all_logits else x[b.last_rows], None, self.norm, eps)  # [T or B, hidden]
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
        if q8 is None or any(fn is not q8 for layer in entries for fn, _, _ in layer) or any(
                layer.qkv_bias is not None or layer.qk_norm is not None for layer in self.layers):
            return None
        args = (kernels.DecodeLayer * len(self.layers))()
        for a, layer, es, kv in zip(args, self.layers, entries, kv_layers, strict=True):
            (_, a.qkv, a.qkv_fmt), (_, a.o, a.o_fmt), (_, a.gate_up, a.gate_up_fmt), (_, a.down, a.down_fmt) = es
            a.attn_norm, a.mlp_norm, a.kv = layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr(), kv.data_ptr()
        self._layer_args = (key, args)
        return args

    def _qkv_extras(self, layer: Layer, qkv: torch.Tensor) -> None:
        """qwen2's q/k/v bias and qwen3's per-head q/k norm, in place on qkv ``[T, H + 2 KV, D]``."""
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias.view(qkv.shape[1:])
        if layer.qk_norm is not None:
            heads = self.config.num_heads + self.config.num_kv_heads
            qkv[:, :heads] = self._rms_norm(qkv[:, :heads], layer.qk_norm)

    def _decode_attention(self, q: torch.Tensor, kv: torch.Tensor, a: _Attn) -> torch.Tensor:
        """``group`` sequences, one query each, all ``S`` long -> ``[group, H D]``: one SDPA call per sequence, whose
        G = H / KV query heads sharing a K/V head are that call's G queries (no causal mask: all sit at the last
        position). One call per sequence because a call over several is not batch-invariant on every CPU (torch
        2.13 on an AVX2 host: a sequence's row changed with the group size at every length in fp32, and at 1,024
        positions x 32 sequences in bf16); on a GPU, one call for the group where ``decode_backend`` is a backend
        that proved batch-invariant at load."""
        cfg, n = self.config, a.group
        KV, D = cfg.num_kv_heads, cfg.head_dim
        q, kv = q.view(n, KV, -1, D), kv.view(n, -1, 2, KV, D)  # [n, KV, G, D], [n, S, 2, KV, D]
        if self.decode_backend is not None:  # verified batch-invariant at load (``decode_attention_backend``)
            with sdpa_kernel(self.decode_backend):
                out = F.scaled_dot_product_attention(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2))
            return out.reshape(n, -1)
        out = q.new_empty(q.shape)
        for i in range(n):
            k, v = kv[i : i + 1, :, 0].transpose(1, 2), kv[i : i + 1, :, 1].transpose(1, 2)  # [1, KV, S, D]
            out[i] = F.scaled_dot_product_attention(q[i : i + 1], k, v)[0]
        return out.view(n, -1)

    def _chunk_attention(self, q: torch.Tensor, kv: torch.Tensor, a: _Attn) -> torch.Tensor:
        """One chunk of n queries over its sequence's S positions -> ``[n, H D]``."""
        # 4-D views (the 3-D form misses the fused CPU kernel)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            kv[:, 0].transpose(0, 1).unsqueeze(0),  # [1, KV, S, D]
            kv[:, 1].transpose(0, 1).unsqueeze(0),
            attn_mask=a.mask,
            is_causal=a.causal,
            enable_gqa=True,
        )  # [1, H, n, D]
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, BlockWeight):
            return kernels.expand_rows(self.embed, tokens)
        return self.embed[tokens]

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(x, layer.gate_up).chunk(2, dim=-1)  # [T, F] each
        return self._linear(F.silu(gate).mul_(up), layer.down)  # [T, hidden]

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """HF LlamaRMSNorm: normalize in float32, round to the model dtype, then scale (same ops, bit for bit)."""
        return w * F.rms_norm(x.float(), x.shape[-1:], eps=self.config.rms_norm_eps).to(x.dtype)

    def _batch(self, chunks: list[SeqChunk], pool: KVPool) -> _Batch:
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        for c in chunks:
            self._check(c, pool)
        groups: dict[int, list[int]] = {}  # decode chunks by sequence length
        longer = []
        for i, c in enumerate(chunks):
            if len(c.token_ids) == 1:
                groups.setdefault(c.start_pos + 1, []).append(i)
            else:
                longer.append(i)
        order = [i for g in groups.values() for i in g] + longer  # processing order
        ps = pool.page_size
        tokens, positions, reads, writes, attn = [], [], [], [], []
        first_row = [0] * len(chunks)
        q0 = k0 = 0
        starts = [0]
        for members in groups.values():
            end = chunks[members[0]].start_pos + 1
            for i in members:
                c, first_row[i] = chunks[i], len(tokens)
                tokens.append(c.token_ids[0])
                positions.append(np.arange(end - 1, end))
                reads.append(_slots(c.page_ids, end, ps))
                writes.append(reads[-1][-1:])
            n = len(members)
            starts.extend(range(k0 + end, k0 + (n + 1) * end, end))
            attn.append(_Attn(q0, q0 + n, k0, k0 + n * end, n, None, False))
            q0, k0 = q0 + n, k0 + n * end
        for i in longer:
            c = chunks[i]
            n, end = len(c.token_ids), c.start_pos + len(c.token_ids)
            first_row[i] = q0
            tokens.extend(c.token_ids)
            positions.append(np.arange(c.start_pos, end))
            reads.append(_slots(c.page_ids, end, ps))
            writes.append(reads[-1][c.start_pos :])
            attn.append(_Attn(q0, q0 + n, k0, k0 + end, 0, _causal_mask(n, end, self.device), c.start_pos == 0))
            q0, k0 = q0 + n, k0 + end
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if int(ids.max()) >= self.config.vocab_size or int(ids.min()) < 0:
            raise ValueError("token id out of range")
        pos = torch.from_numpy(np.concatenate(positions)).to(self.device)
        sizes = [len(c.token_ids) for c in chunks]
        last = torch.tensor([first_row[i] + sizes[i] - 1 for i in order], device=self.device)
        chunk_order = token_order = None
        if order != list(range(len(chunks))):
            chunk_order = torch.from_numpy(np.argsort(order)).to(self.device)
            rows = np.concatenate([np.arange(first_row[i], first_row[i] + sizes[i]) for i in range(len(chunks))])
            token_order = torch.from_numpy(rows).to(self.device)
        return _Batch(
            tokens=ids,
            cos=self.cos[pos].unsqueeze(1),
            sin=self.sin[pos].unsqueeze(1),
            kv_layers=self._pool_layers(pool),
            write_slots=torch.from_numpy(np.concatenate(writes)).to(self.device),
            read_slots=torch.from_numpy(np.concatenate(reads)).to(self.device),
            attn=attn,
            decode_rows=len(starts) - 1,
            decode_kv=starts[-1],
            decode_starts=torch.tensor(starts, dtype=torch.long),
            last_rows=last,
            chunk_order=chunk_order,
            token_order=token_order,
        )

    def _pool_layers(self, pool: KVPool) -> tuple[torch.Tensor, ...]:
        """Per layer, the pool viewed slot by slot ``[num_pages * page_size, 2, KV, D]`` (cached per pool)."""
        key = (pool.data.data_ptr(), tuple(pool.data.shape))
        if self._pool_views is None or self._pool_views[0] != key:
            slots = pool.data.view(-1, *pool.data.shape[2:])  # [num_slots, layers, 2, KV, D]
            self._pool_views = (key, slots.unbind(1))
        return self._pool_views[1]

    def _check(self, c: SeqChunk, pool: KVPool) -> None:
        """A chunk is non-empty, fits the context, and its pages (in the pool) cover its positions."""
        end = c.start_pos + len(c.token_ids)
        used = -(-end // pool.page_size)
        if not c.token_ids or c.start_pos < 0 or used > len(c.page_ids) or end > self.config.max_context:
            raise ValueError(f"bad chunk: {len(c.token_ids)} tokens at {c.start_pos} with {len(c.page_ids)} pages")
        if not all(0 <= p < pool.num_pages for p in c.page_ids[:used]):
            raise ValueError(f"page id out of range (pool has {pool.num_pages} pages)")


def _slots(page_ids: list[int], end: int, page_size: int) -> np.ndarray:
    """Pool slots of positions [0, end) of a sequence holding ``page_ids``: page * page_size + offset."""
    pages = np.asarray(page_ids[: -(-end // page_size)], dtype=np.int64)
    return (pages[:, None] * page_size + np.arange(page_size)).ravel()[:end]


def _causal_mask(n: int, end: int, device: torch.device) -> torch.Tensor | None:
    """Bottom-right aligned causal mask ``[n, end]`` for n queries at positions end - n .. end - 1."""
    if n == 1 or n == end:
        return None  # a single query sees everything; a fresh chunk uses is_causal
    return torch.ones(n, end, dtype=torch.bool, device=device).tril(diagonal=end - n)


def _rope_tables(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin ``[max_context, D]``, computed in float32 like HF, then cast."""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))  # [D/2]
    inv_freq = _scale_rope(inv_freq, cfg.rope_scaling)
    freqs = torch.outer(torch.arange(cfg.max_context, dtype=torch.float32), inv_freq)  # [max_context, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_context, D]
    cos, sin = emb.cos(), emb.sin()
    sin = torch.cat([-sin[:, : D // 2], sin[:, D // 2 :]], dim=-1)  # rotate_half(x) * sin == roll(x) * this
    return cos.to(device, dtype), sin.to(device, dtype)


def _scale_rope(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """Apply HF ``rope_scaling`` to ``inv_freq`` ``[D/2]``: none, linear or llama3 (these keep cos/sin unscaled)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3)")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_mid, mid, scaled)


def _layer(cfg: ModelConfig, get, p: str, sd: dict[str, torch.Tensor]) -> Layer:
    """Fuse one HF decoder layer's tensors (prefix ``p``)."""
    a, m = p + "self_attn.", p + "mlp."
    qkv_bias = None
    if cfg.attention_bias:
        qkv_bias = torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
    qk_norm = None
    if cfg.qk_norm:
        qk_norm = torch.cat(
            [get(a + "q_norm.weight").expand(cfg.num_heads, -1), get(a + "k_norm.weight").expand(cfg.num_kv_heads, -1)]
        )
    if a + "o_proj.bias" in sd:
        raise ValueError("o_proj bias is not supported")
    attn_norm = get(p + "input_layernorm.weight")
    return Layer(
        attn_norm=attn_norm,
        qkv=_rows(attn_norm.dtype, get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        o=get(a + "o_proj.weight"),
        mlp_norm=get(p + "post_attention_layernorm.weight"),
        gate_up=_rows(attn_norm.dtype, get(m + "gate_proj.weight"), get(m + "up_proj.weight")),
        down=get(m + "down_proj.weight"),
    )


def _rows(dtype: torch.dtype, *weights: torch.Tensor | BlockWeight) -> torch.Tensor | BlockWeight:
    """The weights' rows one after another (a fused projection): blocks if all are blocks of one format, else
    ``dtype`` tensors (a GGUF may mix formats, e.g. Q4_1 q/k with a Q8_0 or Q6_K v)."""
    if all(isinstance(w, BlockWeight) for w in weights) and len({w.fmt for w in weights}) == 1:
        return BlockWeight.cat(list(weights))
    return torch.cat([w.dequantize().to(dtype) if isinstance(w, BlockWeight) else w for w in weights])
