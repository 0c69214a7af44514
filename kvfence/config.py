"""Frozen configuration: the model's shape and each engine's limits."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Full-context requests a role's default KV pool holds. Decode keeps requests for their whole life; prefill
# holds a prompt only until its pages reach decode, so one context (what L0 asks) is enough there.
POOL_CONTEXTS = {"prefill": 1, "decode": 2, "colocated": 2}
POOL_DEFAULTS = f"{POOL_CONTEXTS['decode']} x max context; {POOL_CONTEXTS['prefill']} x on prefill workers"


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale ``0.1 * mscale * ln(factor) + 1`` (1 for a factor up to 1): what cos and sin are
    multiplied by (transformers' ``get_mscale``, llama.cpp's default yarn attention factor)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def default_pool_tokens(max_context: int, role: str) -> int:
    return POOL_CONTEXTS[role] * max_context


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder: Llama, Qwen2, Qwen3, and the families that differ from Llama only in the fields
    after ``rope_scaling`` (Mistral, Phi-3, Gemma 2, Gemma 3; the mixture-of-experts Qwen3-MoE and GLM-4-MoE).
    Their defaults are Llama's (dense, every layer one gated MLP)."""

    arch: str  # "llama" | "qwen2" | "qwen3" | "mistral" | "phi3" | "gemma2" | "gemma3" | "qwen3_moe" | "glm4_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_context: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm on q and k per head
    # HF rope_scaling: linear, llama3, yarn, longrope (phi3); or a GGUF's llama3 factors, {"rope_type": "freq_factors",
    # "factors": [D/2 floats]} (llama.cpp's rope_freqs: each inv_freq divided by its factor)
    rope_scaling: dict | None = None
    # a windowed layer's query at position p sees keys (p - sliding_window, p]; one that covers the context is none
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer "sliding" | "full"; empty: every layer is windowed, if any is
    rope_local_theta: float | None = None  # gemma3: the sliding layers' rope theta (default rope, no scaling)
    hidden_act: str = "silu"  # of the gated MLP: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    norm_offset: bool = False  # gemma: RMSNorm scales by (1 + w), in float32, then rounds
    sandwich_norms: bool = False  # gemma: a norm after attention and after the MLP too, before each residual add
    embed_scale: float = 1.0  # gemma: sqrt(hidden), rounded to the model dtype, times each embedding
    query_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5 (gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None  # gemma2: scores become cap * tanh(score / cap)
    final_softcap: float | None = None  # gemma2: logits become cap * tanh(logit / cap)
    rotary_dim: int | None = None  # glm4_moe: rope turns only each head's first rotary_dim dims; None: all of them
    # mixture of experts (qwen3_moe, glm4_moe): each layer of ``sparse_layers`` replaces its MLP by ``num_experts``
    # gated MLPs of ``expert_intermediate_size``, of which a router picks ``experts_per_token`` per token
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    router_scoring: str = "softmax"  # "softmax" (qwen3_moe) | "sigmoid" (glm4_moe: plus a bias for the choice only)
    router_float32: bool = False  # glm4_moe: router matmul and expert weights in float32; else the model dtype
    normalize_expert_weights: bool = False  # the chosen experts' weights divided by their sum (HF norm_topk_prob)
    expert_weight_scale: float = 1.0  # glm4_moe: the chosen weights times this (HF routed_scaling_factor)
    expert_groups: int = 1  # glm4_moe: experts in this many groups (HF n_group) ...
    expert_groups_kept: int = 1  # ... of which the best this many (topk_group) hold every chosen expert
    shared_expert_intermediate_size: int = 0  # glm4_moe: an always-on MLP beside the experts; 0: none

    @property
    def is_moe(self) -> bool:
        """Whether some layer's MLP is a mixture of experts."""
        return bool(self.sparse_layers)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``; None where it attends to the whole sequence."""
        if self.sliding_window is None or self.sliding_window >= self.max_context:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding":
            return None
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with the sliding layers' own table (``rope_local_theta``)."""
        return self.rope_local_theta is not None and (not self.layer_types or self.layer_types[layer] == "sliding")

    @property
    def llama_compatible(self) -> str | None:
        """None where a forward of this config is exactly Llama's (the weights and rope tables aside); else the
        first feature that differs, in words."""
        if any(self.window(i) is not None for i in range(self.num_layers)):
            return f"sliding-window attention ({self.sliding_window} < context {self.max_context})"
        for feature, differs in (
            ("mixture-of-experts MLPs", self.is_moe),
            ("partial rotary embeddings", self.rotary_dim not in (None, self.head_dim)),
            ("per-layer rope tables", self.rope_local_theta is not None),
            (f"the {self.hidden_act} MLP", self.hidden_act != "silu"),
            ("(1 + w) RMSNorm", self.norm_offset),
            ("post-attention/feed-forward norms", self.sandwich_norms),
            ("scaled embeddings", self.embed_scale != 1.0),
            ("a query scale other than head_dim ** -0.5", self.query_scale is not None),
            ("attention logit soft-capping", self.attn_softcap is not None),
            ("final logit soft-capping", self.final_softcap is not None),
        ):
            if differs:
                return feature
        return None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine (colocated) or worker."""

    max_context: int
    kv_pool_tokens: int
    page_size: int = 16
    max_batch: int = 64  # running requests at most
    chunk_size: int = 512  # prefill chunk; chunk boundaries are fixed per request
    step_tokens: int = 512  # prefill tokens at most per step (budget, whole chunks)
    fair: bool = True  # tenants' fair share orders admissions and preemption (False: first come, first served)
    prefix_caching: bool = False  # reuse the KV of prompt prefixes, per tenant (``kvcache/prefix.py``; serve: on)
    role: str = "colocated"  # "colocated", "prefill" or "decode": names the node in the L0 preflight's error

    @property
    def num_pages(self) -> int:
        return self.kv_pool_tokens // self.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


ABORT_SHARE = 3  # the abort timeout is the handoff timeout over this ...
ABORT_CAP_S = 10.0  # ... and this at most: an AbortAck answers at once unless a write is stuck in flight
ORPHAN_DEST_SHARE = 6  # the orphan-Dest timeout is the handoff timeout over this ...
ORPHAN_DEST_CAP_S = 5.0  # ... and this at most: a Prefill and its Dest are sent together, so one comes soon after
WORKER_TIMEOUT_S = 15.0  # the router declares a worker silent this long dead (--worker-timeout)
SILENCE_HANDOFFS = 4  # the router's silence timeout is this many handoff timeouts: beyond any handoff's own end


@dataclass(frozen=True)
class Timeouts:
    """The protocol's timeouts in seconds, all derived from one setting (``--handoff-timeout``).

    - ``handoff``: a handoff (pages granted -> ``Done``) may go this long without a ``Progress``; then it fails.
    - ``abort``: decode waits this long for an ``AbortAck``, then quarantines the pages (never frees them).
    - ``orphan_dest``: prefill keeps a ``Dest`` whose ``Prefill`` has not come this long, then drops it.
    - ``silence``: the router ends a request that has heard nothing from its workers this long (503
      ``worker_silent``); a request may wait as long for its handoff to start (``wait``).
    """

    handoff: float = 30.0

    @property
    def abort(self) -> float:
        return min(ABORT_CAP_S, self.handoff / ABORT_SHARE)

    @property
    def orphan_dest(self) -> float:
        return min(ORPHAN_DEST_CAP_S, self.handoff / ORPHAN_DEST_SHARE)

    @property
    def silence(self) -> float:
        return SILENCE_HANDOFFS * self.handoff

    @property
    def wait(self) -> float:
        return self.silence

