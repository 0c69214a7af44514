"""The forward on torch ops: CPU without C kernels (or where they do not compute the config), float32, and CUDA.

Batch invariance by construction or by calibration: matmuls run in row blocks of calibrated sizes
(``invariant.py``), or row by row in the C kernel where it runs (bf16 on CPU) but its attention does not fit the
model's heads; norms and activations are row-wise; attention never mixes sequences: a decode group runs one SDPA
call per sequence (on a GPU, one call per group where a backend proved batch-invariant at load), each chunk one
call of its own.

Mixture-of-experts layers (Qwen3-MoE, GLM-4-MoE) route each row alone: router logits through the same
batch-invariant matmuls, scores, top-k and normalisation row-wise. Each chosen expert then computes its rows
(gathered, through ``_linear``, so a row's bits do not depend on how many other rows chose that expert), and a
row's expert outputs are summed in ascending expert id into zeros, as transformers' ``index_add_`` does: the
order of a row's additions is a function of that row's choice alone.

The families beyond Llama run here only (``choose_backend``): sliding windows (``Batch.attn_window``), Gemma's
(1 + w) norms, sandwich norms, GeGLU, scaled embeddings, its query scale and soft caps. Each is row-wise or inside
one sequence's attention call, so none of them makes a row depend on its neighbours. Soft-capped attention is
computed in plain ops per chunk or sequence (SDPA has no soft cap), as transformers' eager attention does.

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
from kvfence.model.weights import Experts, Layer, Matrix, Weights

log = logging.getLogger(__name__)


class TorchBackend:
    """The forward of ``weights`` on torch ops (``name``: ``torch``, or ``torch+c-<flavour>-gemm`` where the C
    kernel computes the matmuls)."""

    def __init__(self, config: ModelConfig, weights: Weights, caps: kernels.Capabilities) -> None:
        self.config, self.weights = config, weights
        dtype, device = weights.dtype, weights.device
        self.c_gemm = caps.runs(dtype, device)  # every matmul row in the C kernel; else calibrated row blocks
        self.name = f"torch+c-{caps.flavour}-gemm" if self.c_gemm else "torch"
        self._blocks: dict[tuple[tuple[int, ...], torch.dtype], invariant.RowBlocks] = {}
        self._head_blocks: invariant.RowBlocks | None = None
        self._threads = -1
        if not self.c_gemm or any(not self._in_c(w) for layer in weights.layers for w in layer.all_matmul_weights()):
            self.calibrate()
        # on a GPU, one attention call per group of same-length decode rows where a backend proves batch-invariant
        self.decode_sdpa = (invariant.decode_attention_backend(
            config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim, dtype, str(device))
            if device.type == "cuda" else None)

    def prepare_decode_rows(self) -> None:
        """Nothing to prepare: decode rows use the weights themselves."""

    def set_threads(self, n: int) -> None:
        """Compute on ``n`` threads where that keeps the bits without a recalibration: the C matmuls, and then
        torch's own ops unless some matmul is calibrated (then torch keeps its count)."""
        if self.c_gemm:
            kernels.set_threads(n)
            if not self._blocks and torch.get_num_threads() != n:
                torch.set_num_threads(n)

    def decode_weights(self) -> list[Matrix]:
        """Every weight a decode step reads in full."""
        return self.weights.read_in_full()

    def calibrate(self) -> None:
        """Measure the batch-invariant row blocks, for the current thread count, of every weight shape and dtype the
        C kernel does not compute: with it, only a float32 router's (glm4_moe); without it, every layer's matrices
        (the experts' and routers' included) and the head's."""
        t0, self._threads = time.perf_counter(), torch.get_num_threads()
        for layer in self.weights.layers:
            for w in layer.all_matmul_weights():
                if self._in_c(w):
                    continue
                t = _dense(w)
                key = (tuple(t.shape), t.dtype)
                if key not in self._blocks:
                    self._blocks[key] = invariant.calibrate(*t.shape, t.dtype, str(t.device), self._threads)
        if not self._in_c(self.weights.lm_head):
            # the head sees one row per chunk: no large call sizes (checking them would cost seconds)
            head = _dense(self.weights.lm_head)
            self._head_blocks = invariant.calibrate(*head.shape, head.dtype, str(head.device), self._threads,
                                                    big=False)
        log.info("calibrated batch-invariant matmuls (%s, %d threads) in %.2fs", self.weights.dtype, self._threads,
                 time.perf_counter() - t0)

    def forward(self, b: Batch, all_logits: bool) -> torch.Tensor:
        """``[T or B, vocab]`` logits of step ``b``, rows in processing order, in the model's dtype."""
        if self._blocks and torch.get_num_threads() != self._threads:
            self.calibrate()
        w, cfg = self.weights, self.config
        x = w.embed_rows(b.tokens)  # [T, hidden], a new tensor: updated in place below
        if cfg.embed_scale != 1.0:  # gemma: the scale rounded to the model dtype first, as transformers does
            x *= torch.tensor(cfg.embed_scale, dtype=x.dtype, device=x.device)
        for i, layer in enumerate(w.layers):
            x += self._post(self._attention(i, layer, self._norm(x, layer.attn_norm), b), layer.post_attn_norm)
            x += self._post(self._mlp(layer, self._norm(x, layer.mlp_norm)), layer.post_mlp_norm)
        h = self._norm(x if all_logits else x[b.last_rows], w.norm)  # [T or B, hidden]
        logits = self._linear(h, w.lm_head, blocks=self._head_blocks)  # [T or B, vocab]
        return logits if cfg.final_softcap is None else softcap(logits, cfg.final_softcap)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, w, self.config.rms_norm_eps, self.config.norm_offset)

    def _post(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output, normed where the model has sandwich norms (gemma)."""
        return x if w is None else self._norm(x, w)

    def _in_c(self, w: Matrix) -> bool:
        """Whether the C kernel computes products with ``w`` (every bf16 weight where it runs; not a float32 router)."""
        return self.c_gemm and not (isinstance(w, torch.Tensor) and w.dtype == torch.float32)

    def _linear(self, x: torch.Tensor, w: Matrix, blocks: invariant.RowBlocks | None = None) -> torch.Tensor:
        """``x [T, K] @ w.T`` -> ``[T, N]``, a new tensor in w's dtype (x is cast to it); no row depends on the
        others. The C kernel computes each row alone by construction; without it, calibrated row blocks."""
        if self._in_c(w):
            return kernels.gemm(x, w)
        t = _dense(w)
        return invariant.matmul(x.to(t.dtype).contiguous(), t, blocks or self._blocks[(tuple(t.shape), t.dtype)])

    def _attention(self, i: int, layer: Layer, x: torch.Tensor, b: Batch) -> torch.Tensor:
        cfg, T, slots = self.config, x.shape[0], b.kv_layers[i]
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        window = cfg.window(i)
        rope = b.local_rope if cfg.local_rope(i) else (b.cos, b.sin)
        calls = b.attn if window is None else b.attn_window
        assert rope is not None and calls is not None, "the step was planned without this layer's table or window"
        cos, sin = rope
        qkv = self._linear(x, layer.qkv).view(T, H + 2 * KV, D)  # [T, H + 2 KV, D]
        qkv_extras(cfg, layer, qkv)
        R = cos.shape[-1]  # the rotated dims: D, or the first R of each head (glm4_moe's partial rotary)
        qk = qkv[:, : H + KV, :R]  # [T, H + KV, R], a view of qkv
        rot = qk.roll(R // 2, dims=-1).mul_(sin)  # rotary, HF rotate_half convention, in place in qkv
        qk.mul_(cos).add_(rot)
        slots.index_copy_(0, b.write_slots, qkv[:, H:].view(T, 2, KV, D))  # new tokens' K/V into their slots
        q = qkv[:, :H]  # [T, H, D]
        kv = slots.index_select(0, b.read_slots)  # [S_total, 2, KV, D]
        if len(calls) == 1 and calls[0].group:  # all decode, one length: the output is the attention result
            return self._linear(self._decode_attention(q, kv, calls[0], window), layer.o)  # [T, hidden]
        out = x.new_empty(T, H * D)
        for a in calls:
            if a.group:
                out[a.q0 : a.q1] = self._decode_attention(q[a.q0 : a.q1], kv[a.k0 : a.k1], a, window)
            else:
                out[a.q0 : a.q1] = chunk_attention(q[a.q0 : a.q1], kv[a.k0 : a.k1], a, cfg.query_scale,
                                                   cfg.attn_softcap)
        return self._linear(out, layer.o)  # [T, hidden]

    def _decode_attention(self, q: torch.Tensor, kv: torch.Tensor, a: Attn, window: int | None) -> torch.Tensor:
        """``group`` sequences, one query each, all ``S`` long -> ``[group, H D]``: one SDPA call per sequence, whose
        G = H / KV query heads sharing a K/V head are that call's G queries (no causal mask: all sit at the last
        position; a windowed layer keeps each sequence's last ``window`` positions). One call per sequence because
        a call over several is not batch-invariant on every CPU (torch 2.13 on an AVX2 host: a sequence's row
        changed with the group size at every length in fp32, and at 1,024 positions x 32 sequences in bf16); on a
        GPU, one call for the group where ``decode_sdpa`` is a backend that proved batch-invariant at load (never
        with a soft cap, which SDPA does not compute)."""
        cfg, n = self.config, a.group
        KV, D, scale, cap = cfg.num_kv_heads, cfg.head_dim, cfg.query_scale, cfg.attn_softcap
        q, kv = q.view(n, KV, -1, D), kv.view(n, -1, 2, KV, D)  # [n, KV, G, D], [n, S, 2, KV, D]
        if window is not None:
            kv = kv[:, -window:]  # [n, min(S, window), 2, KV, D]
        if self.decode_sdpa is not None and cap is None:  # verified batch-invariant at load
            with sdpa_kernel(self.decode_sdpa):
                out = F.scaled_dot_product_attention(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2),
                                                     scale=scale)
            return out.reshape(n, -1)
        out = q.new_empty(q.shape)
        for i in range(n):
            k, v = kv[i : i + 1, :, 0].transpose(1, 2), kv[i : i + 1, :, 1].transpose(1, 2)  # [1, KV, S, D]
            out[i] = attend(q[i : i + 1], k, v, None, False, scale, cap)[0]
        return out.view(n, -1)

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP on ``x [T, hidden]`` -> ``[T, hidden]``: one gated MLP, or a mixture of experts."""
        if layer.experts is not None:
            return self._moe(layer.experts, x)
        return self._gated(x, *layer.matrices[2:])

    def _gated(self, x: torch.Tensor, gate_up: Matrix, down: Matrix) -> torch.Tensor:
        """``down(act(gate x) * up x)``: ``x [T, hidden]`` -> ``[T, hidden]``."""
        gate, up = self._linear(x, gate_up).chunk(2, dim=-1)  # [T, F] each
        act = F.silu(gate) if self.config.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        return self._linear(act.mul_(up), down)  # [T, hidden]

    def _moe(self, e: Experts, x: torch.Tensor) -> torch.Tensor:
        """A sparse MLP on ``x [T, hidden]`` -> ``[T, hidden]``, as transformers' experts loop: each chosen expert
        computes its rows, its output times the row's weight for it is rounded to the model dtype and added, in
        ascending expert id, into zeros; then the shared MLP's output, if any. Rows never mix."""
        weights, chosen = route(self.config, self._linear(x, e.router), e.choice_bias)  # [T, k] each
        out = torch.zeros_like(x)  # [T, hidden]
        for expert in chosen.unique().tolist():  # ascending ids
            rows, slot = torch.where(chosen == expert)  # [n] each: a row chooses an expert at most once
            y = self._gated(x[rows], e.gate_up[expert], e.down[expert])  # [n, hidden]
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
        if e.shared_gate_up is not None and e.shared_down is not None:
            out += self._gated(x, e.shared_gate_up, e.shared_down)
        return out


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` ``[T, E]``, each row's bits independent of ``T``: a softmax over ``(x, 0)`` per element, which
    torch computes row by row. Its element-wise sigmoid is not: it rounds differently in its vector body and its
    scalar tail (seen on an AMD EPYC with AVX-512), and which elements fall in the tail depends on the tensor's size."""
    return torch.softmax(torch.stack([x, torch.zeros_like(x)], dim=-1), dim=-1)[..., 0]


def route(cfg: ModelConfig, logits: torch.Tensor,
          choice_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``(weights, experts)`` ``[T, k]`` from its router logits ``[T, E]``, row by row, as the family's
    transformers router. softmax (Qwen3-MoE): float32 probabilities, the top k, divided by their sum where
    ``normalize_expert_weights``, rounded to the logits' dtype. sigmoid (GLM-4-MoE, float32 throughout): scores
    plus ``choice_bias`` choose (within the best ``expert_groups_kept`` groups, a group scored by its two best),
    the unbiased scores weigh, divided by their sum + 1e-20 where normalized, times ``expert_weight_scale``.
    Top-k is sorted (transformers' GLM router asks unsorted): the order only changes the normalizing sum, exactly
    so for k = 2."""
    k = cfg.experts_per_token
    if cfg.router_scoring == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights, chosen = torch.topk(probs, k, dim=-1)  # [T, k] each
        if cfg.normalize_expert_weights:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen
    scores = row_sigmoid(logits.float())  # [T, E]
    choice = scores if choice_bias is None else scores + choice_bias  # [T, E]
    if cfg.expert_groups > 1:
        T, G = choice.shape[0], cfg.expert_groups
        group_scores = choice.view(T, G, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        kept = torch.topk(group_scores, cfg.expert_groups_kept, dim=-1)[1]  # [T, kept]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        choice = choice.masked_fill(~mask.repeat_interleave(choice.shape[1] // G, dim=1), float("-inf"))
    chosen = torch.topk(choice, k, dim=-1)[1]  # [T, k]
    weights = scores.gather(1, chosen)  # [T, k]
    if cfg.normalize_expert_weights:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * cfg.expert_weight_scale, chosen


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """HF LlamaRMSNorm: normalize in float32, round to the model dtype, then scale (same ops, bit for bit).
    ``offset`` (gemma): ``w`` holds 1 + weight in float32, and the product is rounded instead."""
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return (normed * w).to(x.dtype) if offset else w * normed.to(x.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``, in x's dtype (gemma2's logits and attention scores)."""
    return torch.tanh(x / cap) * cap


def qkv_extras(cfg: ModelConfig, layer: Layer, qkv: torch.Tensor) -> None:
    """qwen2's q/k/v bias and qwen3's (or gemma3's) per-head q/k norm, in place on qkv ``[T, H + 2 KV, D]``."""
    if layer.qkv_bias is not None:
        qkv += layer.qkv_bias.view(qkv.shape[1:])
    if layer.qk_norm is not None:
        heads = cfg.num_heads + cfg.num_kv_heads
        qkv[:, :heads] = rms_norm(qkv[:, :heads], layer.qk_norm, cfg.rms_norm_eps, cfg.norm_offset)


def chunk_attention(q: torch.Tensor, kv: torch.Tensor, a: Attn, scale: float | None = None,
                    cap: float | None = None) -> torch.Tensor:
    """One chunk of n queries ``[n, H, D]`` over its sequence's S positions ``[S, 2, KV, D]`` -> ``[n, H D]``;
    ``scale`` None is head_dim ** -0.5, ``cap`` a soft cap on the scores."""
    # 4-D views (the 3-D form misses the fused CPU kernel)
    out = attend(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
        kv[:, 0].transpose(0, 1).unsqueeze(0),  # [1, KV, S, D]
        kv[:, 1].transpose(0, 1).unsqueeze(0),
        a.mask,
        a.causal,
        scale,
        cap,
    )  # [1, H, n, D]
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float | None, cap: float | None) -> torch.Tensor:
    """Attention of q ``[1, H, n, D]`` over k, v ``[1, KV, S, D]`` (H a multiple of KV) -> ``[1, H, n, D]``: SDPA
    without a cap; with one, transformers' eager attention (scores scaled, capped, masked, softmax in float32)."""
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    groups, (n, S) = q.shape[1] // k.shape[1], (q.shape[2], k.shape[2])
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [1, H, S, D]
    scores = softcap((q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale), cap)  # [1,H,n,S]
    if causal:
        mask = torch.ones(n, S, dtype=torch.bool, device=q.device).tril(S - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _dense(w: Matrix) -> torch.Tensor:
    """``w`` as the tensor it is where torch computes with it: block weights are kept only where the C kernels run."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{type(w).__name__} weights need the C kernels")
    return w
