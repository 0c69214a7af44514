"""A dense decoder's weights, fused at load: per layer q/k/v into one ``qkv`` and gate/up into one ``gate_up``
(``Weights.from_state_dict``; Phi-3 ships them fused, in the same row order), layers in order. Gemma's norm
weights are kept as ``1 + w`` in float32, the factor its RMSNorm multiplies by.

A matmul weight is a bf16 (or float32) tensor, a ``BlockWeight`` (GGUF blocks the C kernels expand; kept only
where they run) or ``DecodeBlocks`` (the same blocks regrouped for the int8 kernel: the C backend swaps them in
where every row runs in int8). The embedding is only gathered from (``embed_rows``), unless tied to the head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfence.config import ModelConfig
from kvfence.model import kernels
from kvfence.model.blocks import BlockWeight, DecodeBlocks

Matrix = torch.Tensor | BlockWeight | DecodeBlocks


@dataclass
class Layer:
    """One decoder block's weights, fused: qkv ``[(H + 2 KV) D, hidden]``, gate_up ``[2 F, hidden]``."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Matrix
    qkv_bias: torch.Tensor | None  # [(H + 2 KV) D] (qwen2)
    qk_norm: torch.Tensor | None  # [H + KV, D]: q_norm repeated H times, then k_norm KV times (qwen3)
    o: Matrix  # [hidden, H D]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Matrix
    down: Matrix  # [hidden, F]
    post_attn_norm: torch.Tensor | None = None  # [hidden] (gemma: on the attention's output, before the residual)
    post_mlp_norm: torch.Tensor | None = None  # [hidden] (gemma: on the MLP's output, before the residual)

    @property
    def matrices(self) -> tuple[Matrix, Matrix, Matrix, Matrix]:
        """``(qkv, o, gate_up, down)``: the layer's matmul weights, in the order a step uses them."""
        return self.qkv, self.o, self.gate_up, self.down


@dataclass
class Weights:
    embed: torch.Tensor | BlockWeight  # [vocab, hidden]
    layers: list[Layer]
    norm: torch.Tensor  # [hidden]
    lm_head: Matrix  # [vocab, hidden]; the embedding itself where tied
    dtype: torch.dtype  # of the model: what the forward computes in
    device: torch.device

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, sd: dict[str, torch.Tensor | BlockWeight], dtype: torch.dtype,
                        device: str | torch.device, keep_blocks: bool) -> Weights:
        """Fuse HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...) and cast them to ``dtype`` on
        ``device``. ``keep_blocks``: GGUF block weights stay blocks (the same bits as dequantized, a third of the
        bytes; only where the C kernels run), else they are dequantized here."""

        def get(name: str) -> torch.Tensor | BlockWeight:
            w = sd[name]
            if isinstance(w, BlockWeight):
                if keep_blocks and w.shape[0] % 16 == 0:
                    return w
                w = w.dequantize()
            return w.to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:  # gemma multiplies by (1 + w) in float32, as transformers does
            return get(name).float() + 1.0 if cfg.norm_offset else get(name)

        layers = [_layer(cfg, get, norm, f"model.layers.{i}.", sd) for i in range(cfg.num_layers)]
        embed = get("model.embed_tokens.weight")
        lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
        return cls(embed, layers, norm("model.norm.weight"), lm_head, dtype, torch.device(device))

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``tokens`` ``[T]`` -> ``[T, hidden]``, a new tensor."""
        if isinstance(self.embed, BlockWeight):
            return kernels.expand_rows(self.embed, tokens)
        return self.embed[tokens]

    def read_in_full(self) -> list[Matrix]:
        """Every weight a step reads in full (the embedding is only gathered from, unless tied)."""
        out = [self.norm, self.lm_head]
        for layer in self.layers:
            out += [t for t in vars(layer).values() if t is not None]
        return out


def _layer(cfg: ModelConfig, get: Callable[[str], torch.Tensor | BlockWeight], norm: Callable[[str], torch.Tensor],
           p: str, sd: dict[str, torch.Tensor | BlockWeight]) -> Layer:
    """Fuse one HF decoder layer's tensors (prefix ``p``); ``norm`` fetches a norm weight."""
    a, m = p + "self_attn.", p + "mlp."
    qkv_bias = None
    if cfg.attention_bias:
        qkv_bias = torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
    qk_norm = None
    if cfg.qk_norm:
        q, k = norm(a + "q_norm.weight"), norm(a + "k_norm.weight")
        qk_norm = torch.cat([q.expand(cfg.num_heads, -1), k.expand(cfg.num_kv_heads, -1)])
    if a + "o_proj.bias" in sd:
        raise ValueError("o_proj bias is not supported")
    dtype = get(p + "input_layernorm.weight").dtype
    if a + "qkv_proj.weight" in sd:  # phi3: fused already, rows q, k, v
        qkv = get(a + "qkv_proj.weight")
    else:
        qkv = _rows(dtype, get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"))
    if m + "gate_up_proj.weight" in sd:  # phi3: fused already, rows gate, up
        gate_up = get(m + "gate_up_proj.weight")
    else:
        gate_up = _rows(dtype, get(m + "gate_proj.weight"), get(m + "up_proj.weight"))
    if cfg.sandwich_norms:  # gemma's names: post_attention_layernorm follows the attention, pre_feedforward is mlp's
        post_attn, mlp_norm, post_mlp = (norm(p + n + ".weight") for n in (
            "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"))
    else:
        post_attn, mlp_norm, post_mlp = None, norm(p + "post_attention_layernorm.weight"), None
    return Layer(
        attn_norm=norm(p + "input_layernorm.weight"),
        qkv=qkv,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        o=get(a + "o_proj.weight"),
        mlp_norm=mlp_norm,
        gate_up=gate_up,
        down=get(m + "down_proj.weight"),
        post_attn_norm=post_attn,
        post_mlp_norm=post_mlp,
    )


def _rows(dtype: torch.dtype, *weights: torch.Tensor | BlockWeight) -> torch.Tensor | BlockWeight:
    """The weights' rows one after another (a fused projection): blocks if all are blocks of one format, else
    ``dtype`` tensors (a GGUF may mix formats, e.g. Q4_1 q/k with a Q8_0 or Q6_K v)."""
    if all(isinstance(w, BlockWeight) for w in weights) and len({w.fmt for w in weights}) == 1:
        return BlockWeight.cat(list(weights))
    return torch.cat([w.dequantize().to(dtype) if isinstance(w, BlockWeight) else w for w in weights])
