"""A decoder's weights, fused at load: per layer q/k/v into one ``qkv`` and gate/up into one ``gate_up``
(``Weights.from_state_dict``; Phi-3 ships them fused, in the same row order), layers in order. Gemma's norm
weights are kept as ``1 + w`` in float32, the factor its RMSNorm multiplies by. A sparse layer (Qwen3-MoE,
GLM-4-MoE) holds ``Experts`` instead of one MLP: its router and each expert's fused gate_up and down, read from
hub-style per-expert names (``mlp.experts.N.gate_proj.weight``; a GGUF's stacked expert blocks arrive split so,
and stay blocks as a dense layer's do) or from stacked ``mlp.experts.gate_up_proj``.

A matmul weight is a bf16 (or float32) tensor, a ``BlockWeight`` (GGUF blocks the C kernels expand; kept only
where they run) or ``DecodeBlocks`` (the same blocks regrouped for the int8 kernel: the C backend swaps them in
where every row runs in int8). The embedding is only gathered from (``embed_rows``), unless tied to the head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvfence.config import ModelConfig
from kvfence.model import kernels
from kvfence.model.blocks import BlockWeight, DecodeBlocks

Matrix = torch.Tensor | BlockWeight | DecodeBlocks


@dataclass
class Experts:
    """A sparse MLP's weights: E experts of F rows each, and an optional shared MLP of S rows."""

    router: torch.Tensor  # [E, hidden]; float32 where the family routes in float32 (glm4_moe)
    gate_up: list[Matrix]  # E x [2 F, hidden]: gate rows, then up rows
    down: list[Matrix]  # E x [hidden, F]
    choice_bias: torch.Tensor | None = None  # [E] float32 (glm4_moe's e_score_correction_bias): choice only
    shared_gate_up: Matrix | None = None  # [2 S, hidden] (glm4_moe's shared_experts)
    shared_down: Matrix | None = None  # [hidden, S]

    def tensors(self) -> list[torch.Tensor | Matrix]:
        """Every tensor, router first, then expert by expert, then the shared MLP's."""
        out: list[torch.Tensor | Matrix] = [self.router]
        for gate_up, down in zip(self.gate_up, self.down, strict=True):
            out += [gate_up, down]
        return out + [t for t in (self.choice_bias, self.shared_gate_up, self.shared_down) if t is not None]


@dataclass
class Layer:
    """One decoder block's weights, fused: qkv ``[(H + 2 KV) D, hidden]``, gate_up ``[2 F, hidden]``; a sparse
    layer has ``experts`` and neither gate_up nor down."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Matrix
    qkv_bias: torch.Tensor | None  # [(H + 2 KV) D] (qwen2)
    qk_norm: torch.Tensor | None  # [H + KV, D]: q_norm repeated H times, then k_norm KV times (qwen3)
    o: Matrix  # [hidden, H D]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Matrix | None  # None in a sparse layer
    down: Matrix | None  # [hidden, F]
    post_attn_norm: torch.Tensor | None = None  # [hidden] (gemma: on the attention's output, before the residual)
    post_mlp_norm: torch.Tensor | None = None  # [hidden] (gemma: on the MLP's output, before the residual)
    experts: Experts | None = None  # a sparse layer's MLP (qwen3_moe, glm4_moe)

    @property
    def matrices(self) -> tuple[Matrix, Matrix, Matrix, Matrix]:
        """``(qkv, o, gate_up, down)``: a dense layer's matmul weights, in the order a step uses them."""
        if self.gate_up is None or self.down is None:
            raise ValueError("a sparse layer has no single gate_up and down")
        return self.qkv, self.o, self.gate_up, self.down

    def all_matmul_weights(self) -> list[Matrix]:
        """Every weight the layer multiplies by, in any layer: the experts' and the router's too."""
        out = [self.qkv, self.o] + [w for w in (self.gate_up, self.down) if w is not None]
        if self.experts is not None:
            e = self.experts
            out += [e.router, *e.gate_up, *e.down] + [w for w in (e.shared_gate_up, e.shared_down) if w is not None]
        return out

    def tensors(self) -> list[torch.Tensor | Matrix]:
        """Every tensor of the layer (a sparse layer's experts included)."""
        out = [t for k, t in vars(self).items() if t is not None and k != "experts"]
        return out + (self.experts.tensors() if self.experts is not None else [])


@dataclass
class Weights:
    embed: torch.Tensor | BlockWeight | DecodeBlocks  # [vocab, hidden]; DecodeBlocks: the tied head's copy (c.py)
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

        def tensor(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:  # never blocks: norms, biases, routers
            w = sd[name]
            return (w.dequantize() if isinstance(w, BlockWeight) else w).to(device=device, dtype=as_dtype).contiguous()

        def get(name: str) -> torch.Tensor | BlockWeight:  # a matmul weight: blocks stay where they may
            w = sd[name]
            if isinstance(w, BlockWeight) and keep_blocks and w.shape[0] % 16 == 0:
                return w
            return tensor(name)

        def norm(name: str) -> torch.Tensor:  # gemma multiplies by (1 + w) in float32, as transformers does
            return tensor(name).float() + 1.0 if cfg.norm_offset else tensor(name)

        def router(name: str) -> torch.Tensor:  # glm4_moe's, kept in float32 as transformers keeps it
            return tensor(name, torch.float32 if cfg.router_float32 else dtype)

        layers = [_layer(cfg, get, tensor, norm, i, sd, dtype) for i in range(cfg.num_layers)]
        for i in cfg.sparse_layers:
            layers[i].experts = _experts(cfg, get, tensor, router, f"model.layers.{i}.mlp.", sd, dtype)
        embed = get("model.embed_tokens.weight")
        lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
        return cls(embed, layers, norm("model.norm.weight"), lm_head, dtype, torch.device(device))

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``tokens`` ``[T]`` -> ``[T, hidden]``, a new tensor."""
        if isinstance(self.embed, BlockWeight | DecodeBlocks):
            return kernels.expand_rows(self.embed, tokens)
        return self.embed[tokens]

    def read_in_full(self) -> list[Matrix]:
        """Every weight a step reads in full (the embedding is only gathered from, unless tied). A sparse layer counts
        all its experts: what a step reads when its tokens choose every expert."""
        out = [self.norm, self.lm_head]
        for layer in self.layers:
            out += layer.tensors()
        return out


Get = Callable[[str], torch.Tensor | BlockWeight]  # a matmul weight by name: blocks kept where they run


class GetTensor(Protocol):
    def __call__(self, name: str, as_dtype: torch.dtype = ..., /) -> torch.Tensor:
        """A weight by name as a tensor (of the model's dtype unless ``as_dtype``)."""


def _layer(cfg: ModelConfig, get: Get, tensor: GetTensor, norm: Callable[[str], torch.Tensor], i: int,
           sd: dict[str, torch.Tensor | BlockWeight], dtype: torch.dtype) -> Layer:
    """Fuse HF decoder layer ``i``'s tensors, but a sparse layer's experts (``_experts``); ``norm`` fetches a norm
    weight."""
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    qkv_bias = None
    if cfg.attention_bias:
        qkv_bias = torch.cat([tensor(a + "q_proj.bias"), tensor(a + "k_proj.bias"), tensor(a + "v_proj.bias")])
    qk_norm = None
    if cfg.qk_norm:
        q, k = norm(a + "q_norm.weight"), norm(a + "k_norm.weight")
        qk_norm = torch.cat([q.expand(cfg.num_heads, -1), k.expand(cfg.num_kv_heads, -1)])
    if a + "o_proj.bias" in sd:
        raise ValueError("o_proj bias is not supported")
    if a + "qkv_proj.weight" in sd:  # phi3: fused already, rows q, k, v
        qkv = get(a + "qkv_proj.weight")
    else:
        qkv = _rows(dtype, get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"))
    if i in cfg.sparse_layers:
        gate_up, down = None, None  # experts instead
    elif m + "gate_up_proj.weight" in sd:  # phi3: fused already, rows gate, up
        gate_up, down = get(m + "gate_up_proj.weight"), get(m + "down_proj.weight")
    else:
        gate_up = _rows(dtype, get(m + "gate_proj.weight"), get(m + "up_proj.weight"))
        down = get(m + "down_proj.weight")
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
        down=down,
        post_attn_norm=post_attn,
        post_mlp_norm=post_mlp,
    )


def _experts(cfg: ModelConfig, get: Get, tensor: GetTensor, router: Callable[[str], torch.Tensor], m: str,
             sd: dict[str, torch.Tensor | BlockWeight], dtype: torch.dtype) -> Experts:
    """A sparse layer's MLP (prefix ``m``, ``model.layers.N.mlp.``): per-expert names as hub checkpoints have
    them (``experts.N.gate_proj.weight`` ...), or the stacked ``experts.gate_up_proj`` ``[E, 2 F, hidden]`` and
    ``experts.down_proj`` ``[E, hidden, F]`` of transformers' in-memory layout."""
    x = m + "experts."
    gate_up: list[Matrix]
    down: list[Matrix]
    if x + "gate_up_proj" in sd:  # stacked tensors (HF only: the GGUF loader splits its stacked blocks per expert)
        gate_up = [w.contiguous() for w in tensor(x + "gate_up_proj").unbind(0)]  # E x [2 F, hidden]
        down = [w.contiguous() for w in tensor(x + "down_proj").unbind(0)]  # E x [hidden, F]
    else:
        gate_up = [_rows(dtype, get(f"{x}{e}.gate_proj.weight"), get(f"{x}{e}.up_proj.weight"))
                   for e in range(cfg.num_experts)]
        down = [get(f"{x}{e}.down_proj.weight") for e in range(cfg.num_experts)]
    shared_gate_up = shared_down = None
    if cfg.shared_expert_intermediate_size:
        s = m + "shared_experts."
        shared_gate_up = _rows(dtype, get(s + "gate_proj.weight"), get(s + "up_proj.weight"))
        shared_down = get(s + "down_proj.weight")
    bias = m + "gate.e_score_correction_bias"
    return Experts(
        router=router(m + "gate.weight"),
        gate_up=gate_up,
        down=down,
        choice_bias=tensor(bias, torch.float32) if bias in sd else None,
        shared_gate_up=shared_gate_up,
        shared_down=shared_down,
    )


def _rows(dtype: torch.dtype, *weights: torch.Tensor | BlockWeight) -> torch.Tensor | BlockWeight:
    """The weights' rows one after another (a fused projection): blocks if all are blocks of one format, else
    ``dtype`` tensors (a GGUF may mix formats, e.g. Q4_1 q/k with a Q8_0 or Q6_K v)."""
    blocks = [w for w in weights if isinstance(w, BlockWeight)]
    if len(blocks) == len(weights) and len({w.fmt for w in blocks}) == 1:
        return BlockWeight.cat(blocks)
    return torch.cat([w.dequantize().to(dtype) if isinstance(w, BlockWeight) else w for w in weights])
