"""The forward on torch ops: CPU without C kernels (or where their attention does not fit), float32, and CUDA.

Batch invariance by construction or by calibration: matmuls run in row blocks of calibrated sizes
(``invariant.py``), or row by row in the C kernel where it runs (bf16 on CPU) but its attention does not fit the
model's heads; norms and activations are row-wise; attention never mixes sequences: a decode group runs one SDPA
call per sequence (on a GPU, one call per group where a backend proved batch-invariant at load), each chunk one
call of its own.

The ops shared with the C backend (``rms_norm``, ``qkv_extras``, ``chunk_attention``) live here as functions.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from kvfence.config import ModelConfig
from kvfence.model import invariant, kernels
from kvfence.model.batch import Attn, Batch
from kvfence.model.weights import Layer, Matrix, Weights

log = logging.getLogger(__name__)


class TorchBackend:
    """The forward of ``weights`` on torch ops (``name``: ``torch``, or ``torch+c-<flavour>-gemm`` where the C
    kernel computes the matmuls)."""

    def __init__(self, config: ModelConfig, weights: Weights, caps: kernels.Capabilities) -> None:
        self.config, self.weights = config, weights
        dtype, device = weights.norm.dtype, weights.norm.device
        self.c_gemm = caps.runs(dtype, device)  # every matmul row in the C kernel; else calibrated row blocks
        self.name = f"torch+c-{caps.flavour}-gemm" if self.c_gemm else "torch"
        self._blocks: dict[tuple[int, ...], invariant.RowBlocks] = {}
        self._head_blocks: invariant.RowBlocks | None = None
        self._threads = -1
        if not self.c_gemm:
            self.calibrate()
        # on a GPU, one attention call per group of same-length decode rows where a backend proves batch-invariant
        self.decode_sdpa = (invariant.decode_attention_backend(
            config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim, dtype, str(device))
            if device.type == "cuda" else None)

    def prepare_decode_rows(self) -> None:
        """Nothing to prepare: decode rows use the weights themselves."""

    def set_threads(self, n: int) -> None:
        """Compute on ``n`` threads where that keeps the bits without a recalibration: the C matmuls, and then
        torch's own ops; calibrated torch matmuls keep their count."""
        if self.c_gemm:
            kernels.set_threads(n)
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)

    def decode_weights(self) -> list[Matrix]:
        """Every weight a decode step reads in full."""
        return self.weights.read_in_full()

    def calibrate(self) -> None:
        """Measure the batch-invariant row blocks of every weight shape for the current thread count."""
        t0, self._threads = time.perf_counter(), torch.get_num_threads()
        for w in self.weights.layers[0].matrices:
            self._blocks[tuple(w.shape)] = invariant.calibrate(*w.shape, w.dtype, str(w.device), self._threads)
        head = self.weights.lm_head  # sees one row per chunk: no large call sizes (checking them would cost seconds)
        self._head_blocks = invariant.calibrate(*head.shape, head.dtype, str(head.device), self._threads, big=False)
        log.info("calibrated batch-invariant matmuls (%s, %d threads) in %.2fs", head.dtype, self._threads,
                 time.perf_counter() - t0)

    def forward(self, b: Batch, all_logits: bool) -> torch.Tensor:
        """``[T or B, vocab]`` logits of step ``b``, rows in processing order, in the model's dtype."""
        if not self.c_gemm and torch.get_num_threads() != self._threads:
            self.calibrate()
        w, eps = self.weights, self.config.rms_norm_eps
        x = w.embed_rows(b.tokens)  # [T, hidden], a new tensor: updated in place below
        for i, layer in enumerate(w.layers):
            x += self._attention(layer, rms_norm(x, layer.attn_norm, eps), b, b.kv_layers[i])
            x += self._mlp(layer, rms_norm(x, layer.mlp_norm, eps))
        h = rms_norm(x if all_logits else x[b.last_rows], w.norm, eps)  # [T or B, hidden]
        return self._linear(h, w.lm_head, blocks=self._head_blocks)  # [T or B, vocab]

    def _linear(self, x: torch.Tensor, w: Matrix, blocks: invariant.RowBlocks | None = None) -> torch.Tensor:
        """``x [T, K] @ w.T`` -> ``[T, N]``, a new tensor; no row depends on the others. The C kernel computes each
        row alone by construction; without it, calibrated row blocks."""
        if self.c_gemm:
            return kernels.gemm(x, w)
        return invariant.matmul(x, w, blocks or self._blocks[tuple(w.shape)])

    def _attention(self, layer: Layer, x: torch.Tensor, b: Batch, slots: torch.Tensor) -> torch.Tensor:
        cfg, T = self.config, x.shape[0]
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self._linear(x, layer.qkv).view(T, H + 2 * KV, D)  # [T, H + 2 KV, D]
        qkv_extras(cfg, layer, qkv)
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
                out[a.q0 : a.q1] = chunk_attention(q[a.q0 : a.q1], kv[a.k0 : a.k1], a)
        return self._linear(out, layer.o)  # [T, hidden]

    def _decode_attention(self, q: torch.Tensor, kv: torch.Tensor, a: Attn) -> torch.Tensor:
        """``group`` sequences, one query each, all ``S`` long -> ``[group, H D]``: one SDPA call per sequence, whose
        G = H / KV query heads sharing a K/V head are that call's G queries (no causal mask: all sit at the last
        position). One call per sequence because a call over several is not batch-invariant on every CPU (torch
        2.13 on an AVX2 host: a sequence's row changed with the group size at every length in fp32, and at 1,024
        positions x 32 sequences in bf16); on a GPU, one call for the group where ``decode_sdpa`` is a backend
        that proved batch-invariant at load."""
        cfg, n = self.config, a.group
        KV, D = cfg.num_kv_heads, cfg.head_dim
        q, kv = q.view(n, KV, -1, D), kv.view(n, -1, 2, KV, D)  # [n, KV, G, D], [n, S, 2, KV, D]
        if self.decode_sdpa is not None:  # verified batch-invariant at load (``decode_attention_backend``)
            with sdpa_kernel(self.decode_sdpa):
                out = F.scaled_dot_product_attention(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2))
            return out.reshape(n, -1)
        out = q.new_empty(q.shape)
        for i in range(n):
            k, v = kv[i : i + 1, :, 0].transpose(1, 2), kv[i : i + 1, :, 1].transpose(1, 2)  # [1, KV, S, D]
            out[i] = F.scaled_dot_product_attention(q[i : i + 1], k, v)[0]
        return out.view(n, -1)

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(x, layer.gate_up).chunk(2, dim=-1)  # [T, F] each
        return self._linear(F.silu(gate).mul_(up), layer.down)  # [T, hidden]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalize in float32, round to the model dtype, then scale (same ops, bit for bit)."""
    return w * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def qkv_extras(cfg: ModelConfig, layer: Layer, qkv: torch.Tensor) -> None:
    """qwen2's q/k/v bias and qwen3's per-head q/k norm, in place on qkv ``[T, H + 2 KV, D]``."""
    if layer.qkv_bias is not None:
        qkv += layer.qkv_bias.view(qkv.shape[1:])
    if layer.qk_norm is not None:
        heads = cfg.num_heads + cfg.num_kv_heads
        qkv[:, :heads] = rms_norm(qkv[:, :heads], layer.qk_norm, cfg.rms_norm_eps)


def chunk_attention(q: torch.Tensor, kv: torch.Tensor, a: Attn) -> torch.Tensor:
    """One chunk of n queries ``[n, H, D]`` over its sequence's S positions ``[S, 2, KV, D]`` -> ``[n, H D]``."""
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
