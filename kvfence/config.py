"""Frozen configuration: the model's shape and each engine's limits."""

from __future__ import annotations

from dataclasses import dataclass

# Full-context requests a role's default KV pool holds. Decode keeps requests for their whole life; prefill
# holds a prompt only until its pages reach decode, so one context (what L0 asks) is enough there.
POOL_CONTEXTS = {"prefill": 1, "decode": 2, "colocated": 2}
POOL_DEFAULTS = f"{POOL_CONTEXTS['decode']} x max context; {POOL_CONTEXTS['prefill']} x on prefill workers"


def default_pool_tokens(max_context: int, role: str) -> int:
    return POOL_CONTEXTS[role] * max_context


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Qwen2, Qwen3)."""

    arch: str  # "llama" | "qwen2" | "qwen3"
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
    rope_scaling: dict | None = None  # HF rope_scaling (llama3 style supported)

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

    @property
    def num_pages(self) -> int:
        return self.kv_pool_tokens // self.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)
