"""A Llama-family model (Llama, Qwen2, Qwen3): its config, its weights (``weights.py``) and rotary tables; the
forward over the paged KV pool is its backend's (``backends/``), chosen at load from the host's capabilities.

``Model.forward`` plans the step (``batch.py``: rows reordered, decode groups first), has the backend compute it,
and restores the caller's order in the logits. A chunk's logits are bit-identical whatever other chunks share the
call: every backend computes a row (or a sequence and head) alone.
"""

from __future__ import annotations

import math
import os

import torch

from kvfence.config import ModelConfig
from kvfence.kvcache.pool import KVPool
from kvfence.model import kernels
from kvfence.model.backends import Backend, choose_backend
from kvfence.model.batch import SeqChunk, make_batch
from kvfence.model.blocks import BlockWeight
from kvfence.model.weights import Weights


class Model:
    """A decoder's config, weights and layer order, and the backend that computes its forward (built over these
    same ``weights``: it may regroup them at construction, ``Backend``)."""

    def __init__(self, config: ModelConfig, weights: Weights, backend: Backend) -> None:
        self.config, self.weights, self.backend = config, weights, backend
        self.dtype, self.device = weights.norm.dtype, weights.norm.device
        self.cos, self.sin = _rope_tables(config, self.dtype, self.device)  # [max_context, D] each
        self._pool_views: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    @classmethod
    def from_state_dict(
        cls, cfg: ModelConfig, sd: dict[str, torch.Tensor | BlockWeight], dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
    ) -> Model:
        """Build from HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...) on the backend this host
        runs. GGUF block weights stay blocks wherever the C kernels run (bf16, unless ``KVFENCE_KEEP_BLOCKS=0``);
        elsewhere they are dequantized."""
        caps, where = kernels.detect(), torch.device(device)
        keep = caps.runs(dtype, where) and os.environ.get("KVFENCE_KEEP_BLOCKS", "1") != "0"
        weights = Weights.from_state_dict(cfg, sd, dtype, device, keep_blocks=keep)
        return cls(cfg, weights, choose_backend(caps, cfg, dtype, where)(cfg, weights, caps))

    def forward(self, chunks: list[SeqChunk], pool: KVPool, all_logits: bool = False) -> torch.Tensor:
        """Run one step: for each chunk write its K/V into the pool at its slots and attend over positions
        [0, start_pos + n) of its own sequence (causal).

        Returns float32 logits: ``[len(chunks), vocab]`` for each chunk's last token, or ``[sum(n), vocab]`` for
        every token when ``all_logits``. Each row is bit-identical whatever other chunks share the call.
        """
        with torch.inference_mode():
            b = make_batch(chunks, pool, self._pool_layers(pool), self.config, self.cos, self.sin)
            logits = self.backend.forward(b, all_logits)
            order = b.token_order if all_logits else b.chunk_order
            return (logits if order is None else logits[order]).float()

    __call__ = forward

    def _pool_layers(self, pool: KVPool) -> tuple[torch.Tensor, ...]:
        """Per layer, the pool viewed slot by slot ``[num_pages * page_size, 2, KV, D]`` (cached per pool)."""
        if self._pool_views is None or self._pool_views[0] is not pool.data:
            slots = pool.data.view(-1, *pool.data.shape[2:])  # [num_slots, layers, 2, KV, D]
            self._pool_views = (pool.data, slots.unbind(1))
        return self._pool_views[1]


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
