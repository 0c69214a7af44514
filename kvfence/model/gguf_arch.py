"""GGUF architectures: llama.cpp's metadata and tensor names -> kvfence's ``ModelConfig`` and HF tensor names.

Supported ``general.architecture``s, each a family the HF path computes: ``llama`` (llama3 rope scaling from the
``rope_freqs`` factors; Mistral too, which llama.cpp's converter writes as ``llama`` without its sliding window, so
llama.cpp and kvfence compute it with full attention), ``qwen2``, ``qwen3``, ``qwen3moe``, ``phi3`` (fused qkv and
gate_up, longrope from the ``rope_factors_long/short`` tensors), ``gemma2``, ``gemma3`` and ``glm4moe``; rope
scaling ``yarn`` on any of them, as llama.cpp computes it (``_yarn``). Where llama.cpp fixes a hyperparameter in its
code rather than in the file (Gemma's attention scale by model size, Gemma 3's local rope base and layer pattern,
Qwen3-MoE's normalized expert weights, yarn's betas), the config takes llama.cpp's value, so a GGUF computes what
llama.cpp computes from it. Torch-free: the router reads configs through here.
"""

from __future__ import annotations

import math
from typing import Any

from kvfence.config import ModelConfig, yarn_mscale
from kvfence.model.gguf_file import GGUFFile

ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "glm4moe")
_KVFENCE_ARCH = {"qwen3moe": "qwen3_moe", "glm4moe": "glm4_moe"}  # the others keep their name
_MOE = ("qwen3moe", "glm4moe")
# llama.cpp's ``LLM_TYPE_27B`` (by layer count), the one Gemma size whose attention scale is (hidden / heads) ** -0.5
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# blk.N.<name> -> model.layers.N.<HF name>; a ``*`` stands for the expert index of a stacked [E, ...] tensor
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",  # its .bias, under one HF name
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# where a family's names differ: Gemma's four norms, GLM's MLP norm; Phi-3's ffn_up holds gate and up rows fused
_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "glm4moe": {"post_attention_norm": "post_attention_layernorm"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
# what llama.cpp computes yarn with where its loader reads no ``rope.scaling.<key>`` (all but grok's and mistral3's)
_LLAMA_CPP_YARN = {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_ext_factor": 1.0, "yarn_log_multiplier": 0.0}
# tensors that are no weights: rope frequency factors, read into the config
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(arch: str, gguf_name: str, num_layers: int) -> str | None:
    """The HF state-dict name of GGUF tensor ``gguf_name``; None for one kvfence does not load (rope factors, a
    layer past ``num_layers``: GLM's next-token-prediction layers). ValueError for a name it does not know."""
    parts = gguf_name.split(".")  # blk.N.attn_q.weight | token_embd.weight
    if gguf_name in ROPE_TENSORS:
        return None
    if parts[0] == "blk" and len(parts) == 4:
        if int(parts[1]) >= num_layers:
            return None
        name = _ARCH_LAYER_NAMES.get(arch, {}).get(parts[2]) or _LAYER_NAMES.get(parts[2])
        if name is not None:
            return f"model.layers.{parts[1]}.{name}" + ("" if name.endswith("_bias") else f".{parts[3]}")
    elif len(parts) == 2 and parts[0] in _NAMES:
        return f"{_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} of a {arch!r} model is not supported")


def gguf_config(parsed: GGUFFile) -> ModelConfig:
    """The config of a GGUF of one of ``ARCHS``; ValueError, naming the file, for another architecture or a feature
    kvfence does not compute (rope scaling other than llama3 factors, linear, longrope and yarn as llama.cpp computes
    it; per-layer head counts)."""
    meta, arch = parsed.metadata, parsed.metadata.get("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"{parsed.path.name}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(ARCHS)})")
    names = {t.name for t in parsed.tensors}

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):
            raise ValueError(f"{parsed.path.name}: per-layer {arch}.{key} is not supported")
        return value

    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    num_layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary != head_dim and arch != "glm4moe":
        raise ValueError(f"{parsed.path.name}: partial rotary embeddings are not supported for {arch!r}")
    gemma = arch.startswith("gemma")
    return ModelConfig(
        arch=_KVFENCE_ARCH.get(arch, arch),
        vocab_size=int(get("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(get("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=_rope_scaling(parsed, arch, get),
        # 0 is none: llama.cpp's converter writes it for a Phi-3 without a window (Phi-4), and its loader reads so
        sliding_window=(get("attention.sliding_window") or None) if arch in ("phi3", "gemma2", "gemma3") else None,
        layer_types=_gemma_layer_types(arch, num_layers, meta) if gemma else (),
        rope_local_theta=float(get("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        hidden_act="gelu_tanh" if gemma else "silu",
        norm_offset=gemma,
        sandwich_norms=gemma,
        embed_scale=hidden**0.5 if gemma else 1.0,
        query_scale=_query_scale(arch, num_layers, hidden, heads, head_dim, get),
        attn_softcap=get("attn_logit_softcapping") if arch == "gemma2" else None,
        final_softcap=get("final_logit_softcapping") if arch == "gemma2" else None,
        rotary_dim=rotary if arch == "glm4moe" else None,
        **(_moe(arch, num_layers, names, get) if arch in _MOE else {}),
    )


def _rope_scaling(parsed: GGUFFile, arch: str, get: Any) -> dict | None:
    """HF-style ``rope_scaling``: ``freq_factors`` (llama3's, as ``rope_freqs`` holds them: inv_freq divided by
    each), ``longrope`` (Phi-3's long and short factors), ``linear``, ``yarn`` (``_yarn``), or None."""
    tensors = {t.name: t for t in parsed.tensors if t.name in ROPE_TENSORS}

    def factors(name: str) -> list[float]:
        return [float(x) for x in parsed.tensor_data(tensors[name]).reshape(-1)]

    kind = get("rope.scaling.type", "none")
    if kind == "yarn":
        if tensors:
            raise ValueError(f"{parsed.path.name}: GGUF yarn rope scaling with rope factor tensors is not supported")
        return _yarn(parsed.path.name, get)
    if "rope_factors_long.weight" in tensors:
        orig = int(get("rope.scaling.original_context_length"))
        return {"rope_type": "longrope", "long_factor": factors("rope_factors_long.weight"),
                "short_factor": factors("rope_factors_short.weight"), "original_max_position_embeddings": orig,
                "factor": int(get("context_length")) / orig, "attention_factor": get("rope.scaling.attn_factor")}
    if "rope_freqs.weight" in tensors:
        return {"rope_type": "freq_factors", "factors": factors("rope_freqs.weight")}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if kind != "none":
        raise ValueError(f"{parsed.path.name}: GGUF rope scaling {kind!r} is not supported (llama3 factors, "
                         "longrope, linear, yarn)")
    return None


def _yarn(file: str, get: Any) -> dict:
    """HF-style yarn computing what llama.cpp computes from the file for these architectures: ``rope.scaling.factor``
    over ``rope.scaling.original_context_length`` (else ``context_length``) positions, betas 32 and 1, truncated
    correction dims, cos/sin times 0.1 ln(factor) + 1 and ``rope.scaling.attn_factor``. llama.cpp's loaders of these
    architectures read no ``rope.scaling.yarn_*`` key (its converter writes them from config.json), so a file whose
    keys ask for other values than llama.cpp's is refused (ValueError, one line): transformers would honour them."""
    factor = float(get("rope.scaling.factor", 0.0)) or 1.0
    mscale = yarn_mscale(factor)
    for key, value in (_LLAMA_CPP_YARN | {"yarn_attn_factor": mscale}).items():
        found = get(f"rope.scaling.{key}")
        if found is not None and not math.isclose(found, value, rel_tol=1e-6):
            raise ValueError(f"{file}: GGUF rope.scaling.{key} {found:g} is not supported (llama.cpp computes yarn "
                             f"with {value:g} here)")
    return {"rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length",
                                                        get("context_length"))),
            "attention_factor": mscale * float(get("rope.scaling.attn_factor", 1.0))}


def _gemma_layer_types(arch: str, num_layers: int, meta: dict[str, Any]) -> tuple[str, ...]:
    """Which layers are sliding: the file's ``attention.sliding_window_pattern`` (a period, or a flag per layer),
    else llama.cpp's fixed period (Gemma 2: every other layer, from the first; Gemma 3: five of every six)."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        return tuple("sliding" if p else "full" for p in pattern[:num_layers])
    return tuple("sliding" if i % pattern < pattern - 1 else "full" for i in range(num_layers))


def _query_scale(arch: str, num_layers: int, hidden: int, heads: int, head_dim: int, get: Any) -> float | None:
    """The attention score scale where it is not head_dim ** -0.5: the file's ``attention.scale``, else Gemma 27B's
    (hidden / heads) ** -0.5 as llama.cpp picks it."""
    scale = get("attention.scale")
    if scale is None and _GEMMA_27B_LAYERS.get(arch) == num_layers:
        scale = (hidden // heads) ** -0.5
    return None if scale is None or scale == head_dim**-0.5 else float(scale)


def _moe(arch: str, num_layers: int, names: set[str], get: Any) -> dict[str, Any]:
    """The mixture-of-experts fields: a layer is sparse where the file has its router (``ffn_gate_inp``)."""
    sparse = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in names)
    fields: dict[str, Any] = dict(
        num_experts=int(get("expert_count")),
        experts_per_token=int(get("expert_used_count")),
        expert_intermediate_size=int(get("expert_feed_forward_length")),
        sparse_layers=sparse,
    )
    if arch == "qwen3moe":  # llama.cpp always normalizes Qwen3-MoE's chosen weights
        return fields | dict(normalize_expert_weights=True)
    if get("expert_gating_func", 2) != 2 or get("expert_group_count", 1) != 1:
        raise ValueError("glm4moe: routing other than sigmoid over one expert group is not supported")
    return fields | dict(
        router_scoring="sigmoid",
        router_float32=True,
        normalize_expert_weights=bool(get("expert_weights_norm", False)),
        expert_weight_scale=float(get("expert_weights_scale", 1.0)),
        shared_expert_intermediate_size=int(get("expert_feed_forward_length")) * int(get("expert_shared_count", 0)),
    )
