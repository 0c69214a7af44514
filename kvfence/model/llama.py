"""A decoder (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3; Qwen3-MoE, GLM-4-MoE): its config, its weights
(``weights.py``) and rotary tables; the forward over the paged KV pool is its backend's (``backends/``), chosen at
load from the host's capabilities and what the config needs.

``Model.forward`` plans the step (``batch.py``: rows reordered, decode groups first), has the backend compute it,
and restores the caller's order in the logits. A chunk's logits are bit-identical whatever other chunks share the
call: every backend computes a row (or a sequence and head) alone.
"""

from __future__ import annotations

import math

import torch

from kvfence import env
from kvfence.config import ModelConfig, yarn_mscale
from kvfence.kvcache.pool import KVPool
from kvfence.model import kernels
from kvfence.model.backends import Backend, choose_backend
from kvfence.model.batch import SeqChunk, make_batch
from kvfence.model.blocks import BlockWeight
from kvfence.model.weights import Weights


class Model:
    """A decoder's config, weights and layer order, and the backend that computes its forward (built over these
    same ``weights``: it may regroup them at construction, ``Backend``)."""

    def __init__(self, config: ModelConfig, weights: Weights, backend: Backend, backend_reason: str = "") -> None:
        self.config, self.weights, self.backend = config, weights, backend
        self.backend_reason = backend_reason  # why this backend (``choose_backend``), for the load log
        self.dtype, self.device = weights.dtype, weights.device
        self.cos, self.sin = _rope_tables(config, self.dtype, self.device)  # [max_context, D] each
        # gemma3's sliding layers rotate with a table of their own
        self.local_rope = (None if config.rope_local_theta is None else
                           _rope_tables(config, self.dtype, self.device, config.rope_local_theta, None))
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
        keep = caps.runs(dtype, where) and env.keep_blocks()
        weights = Weights.from_state_dict(cfg, sd, dtype, device, keep_blocks=keep)
        backend, why = choose_backend(caps, cfg, dtype, where)
        return cls(cfg, weights, backend(cfg, weights, caps), why)

    def forward(self, chunks: list[SeqChunk], pool: KVPool, all_logits: bool = False) -> torch.Tensor:
        """Run one step: for each chunk write its K/V into the pool at its slots and attend over positions
        [0, start_pos + n) of its own sequence (causal).

        Returns float32 logits: ``[len(chunks), vocab]`` for each chunk's last token, or ``[sum(n), vocab]`` for
        every token when ``all_logits``. Each row is bit-identical whatever other chunks share the call.
        """
        with torch.inference_mode():
            b = make_batch(chunks, pool, self._pool_layers(pool), self.config, self.cos, self.sin, self.local_rope)
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


def _rope_tables(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, theta: float | None = None,
                 scaling: dict | None | bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin ``[max_context, D]`` (D the rotated dims: ``rotary_dim``, else ``head_dim``), computed
    in float32 like HF, then cast. ``theta`` and ``scaling`` default to the config's (``scaling=None``: none).

    yarn is one set of frequencies for every position and scales cos and sin by its attention factor, as
    transformers' ``_compute_yarn_parameters`` and rotary embedding do, so the two agree at every position.

    longrope (Phi-3) is a table per position: positions below ``original_max_position_embeddings`` (``orig``)
    rotate with the short factors, the others with the long ones, both scaled by the attention factor, as
    transformers' ``_compute_longrope_parameters``. transformers picks one set per forward call (long if the call
    reaches past ``orig``), and its ``generate`` recomputes the whole cache with the long factors when a sequence
    grows past ``orig``. So the two agree exactly on every sequence that stays within ``orig`` positions (and with
    transformers' forward run one token at a time past it); beyond, kvfence keeps the positions below ``orig`` on the
    short factors. A fixed table keeps a position's K/V a function of the tokens alone: pages are written once,
    moved between workers and checksummed, whatever the chunking, the batch, or a recompute."""
    D, theta = cfg.rotary_dim or cfg.head_dim, cfg.rope_theta if theta is None else theta  # D: the rotated dims
    scaling = cfg.rope_scaling if scaling is True else scaling or None
    shape = torch.arange(0, D, 2, dtype=torch.int64).float() / D  # [D/2]
    positions = torch.arange(cfg.max_context, dtype=torch.float32)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    attention_factor = 1.0
    if kind == "longrope":
        assert scaling is not None  # without one the kind is "default"
        short, long, attention_factor = _longrope(scaling, theta, shape)
        orig = min(scaling["original_max_position_embeddings"], cfg.max_context)
        freqs = torch.cat([torch.outer(positions[:orig], short), torch.outer(positions[orig:], long)])
    elif kind == "yarn":
        assert scaling is not None  # without one the kind is "default"
        inv_freq, attention_factor = _yarn(scaling, theta, shape, D)  # [D/2]
        freqs = torch.outer(positions, inv_freq)  # [max_context, D/2]
    else:
        inv_freq = _scale_rope(1.0 / (theta**shape), scaling)  # [D/2]
        freqs = torch.outer(positions, inv_freq)  # [max_context, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_context, D]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    sin = torch.cat([-sin[:, : D // 2], sin[:, D // 2 :]], dim=-1)  # rotate_half(x) * sin == roll(x) * this
    return cos.to(device, dtype), sin.to(device, dtype)


def _longrope(scaling: dict, theta: float, shape: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(short inv_freq, long inv_freq, attention factor)`` as transformers' ``_compute_longrope_parameters``."""
    orig, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    short, long = (1.0 / (torch.tensor(scaling[k], dtype=torch.float32) * theta**shape)
                   for k in ("short_factor", "long_factor"))
    return short, long, attention_factor


def _yarn(scaling: dict, theta: float, shape: torch.Tensor, D: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [D/2], attention factor)`` as transformers' ``_compute_yarn_parameters``, op for op: each
    frequency blends its own value (extrapolation) and its value over ``factor`` (interpolation) along a ramp over
    the dims between those turning ``beta_fast`` and ``beta_slow`` times in ``original_max_position_embeddings``
    positions. ``factor`` and ``original_max_position_embeddings`` must be set (``describe`` fills them in)."""
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits ``rotations`` times in orig
        return (D * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    extrapolation = 1 - ramp  # the share of each dim's own frequency
    pos_freqs = theta**shape  # [D/2]
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, attention_factor


def _scale_rope(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """Apply HF ``rope_scaling`` to ``inv_freq`` ``[D/2]``: none, linear, llama3, or a GGUF's llama3 factors
    (``freq_factors``: what llama3 computes, as llama.cpp's ``rope_freqs`` stores it); these keep cos/sin unscaled."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    assert scaling is not None  # without one the kind is "default"
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3, yarn, longrope, "
                         "freq_factors)")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_mid, mid, scaled)
