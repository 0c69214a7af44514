"""A small HF -> GGUF converter for tests, following llama.cpp's ``convert_hf_to_gguf.py``: its tensor names, its
metadata keys (yarn's ``rope.scaling.*`` included), its Q/K row permutation for llama (Mistral too, which it writes as
``llama`` without the sliding window), its fused tensors for phi3, its ``+ 1`` on Gemma's norms and its
``rope_freqs`` factors for llama3 rope scaling. Tensors are written as float32 (``F32``), so what kvfence reads back
is exactly the HF weights, but those ``formats`` names: quantized by ``gguf.quants.quantize`` (Q4_1, Q8_0), as
llama.cpp's converter quantizes with ``--outtype``.

``write_gguf(hf_dir, path)`` converts a tiny model directory (``tests/tiny_models.py``) with its byte-level BPE
tokenizer; ``sentencepiece_fields(model_file, kind)`` gives the ``tokenizer.ggml.*`` fields llama.cpp writes for a
SentencePiece model (``llama`` BPE or ``t5`` Unigram), and ``write_fields`` writes a GGUF of fields alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

# -- tokenizers -----------------------------------------------------------------------------------------------------


def sentencepiece_fields(model_file: Path, kind: str) -> dict[str, Any]:
    """The tokenizer fields llama.cpp's ``_create_vocab_sentencepiece`` (``kind`` ``"llama"``) or its T5 converter
    (``"t5"``: plus the normalizer's precompiled charsmap) writes for a SentencePiece ``model_file``. Its
    user-defined pieces are written as the converter writes those ``tokenizer_config.json``'s
    ``added_tokens_decoder`` lists as not special (Gemma's runs of U+2581, of newlines and of tabs, its HTML tags):
    ``USER_DEFINED``, score -1000, each U+2581 a bare space (llama.cpp matches them in the raw text)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    proto = pb.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    tokens = [sp.IdToPiece(i) for i in range(sp.vocab_size())]
    scores = [sp.GetScore(i) for i in range(sp.vocab_size())]
    types = []
    for i in range(sp.vocab_size()):
        types.append(gguf.TokenType.CONTROL if sp.IsControl(i) else gguf.TokenType.UNKNOWN if sp.IsUnknown(i)
                     else gguf.TokenType.UNUSED if sp.IsUnused(i) else gguf.TokenType.BYTE if sp.IsByte(i)
                     else gguf.TokenType.NORMAL)
        if proto.pieces[i].type == pb.ModelProto.SentencePiece.USER_DEFINED:
            types[i], tokens[i], scores[i] = gguf.TokenType.USER_DEFINED, tokens[i].replace("\u2581", " "), -1000.0
    fields: dict[str, Any] = {
        "tokenizer.ggml.model": kind,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
        "tokenizer.ggml.add_bos_token": False,
    }
    if kind == "t5":
        fields["tokenizer.ggml.remove_extra_whitespaces"] = proto.normalizer_spec.remove_extra_whitespaces
        fields["tokenizer.ggml.precompiled_charsmap"] = proto.normalizer_spec.precompiled_charsmap
    return fields


def byte_level_fields(tokenizer_json: Path, pre: str) -> dict[str, Any]:
    """The tokenizer fields of a byte-level BPE ``tokenizer.json`` (``tokenizer.ggml.model`` ``gpt2``)."""
    tok = json.loads(tokenizer_json.read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    for added in tok.get("added_tokens", []):
        types[added["id"]] = int(gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }


def write_fields(path: Path, arch: str, fields: dict[str, Any], tensors: dict[str, np.ndarray] | None = None,
                 formats: dict[str, str] | None = None) -> Path:
    """Write a GGUF of ``fields`` (typed as ``gguf.GGUFWriter`` types Python values: ints as int32 or uint32, floats
    as float32, bytes as uint8 arrays) and float32 ``tensors`` (HF-ordered shapes: the writer reverses them); a
    tensor ``formats`` names (by its GGUF name without ``.weight``, or that name's last part: ``ffn_up_exps``) is
    quantized to that format."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            (w.add_int32 if value < 0 else w.add_uint32)(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, t in (tensors or {}).items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        fmt = _format(name, formats or {})
        if fmt is None:
            w.add_tensor(name, t)
        else:
            qtype = getattr(gguf.GGMLQuantizationType, fmt)
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- models ---------------------------------------------------------------------------------------------------------

# llama.cpp converts MistralForCausalLM with its Llama converter: arch ``llama``, no sliding window
_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
          "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "Phi3ForCausalLM": "phi3",
          "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Glm4MoeForCausalLM": "glm4moe"}


_MODEL_ARCH = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}


def write_gguf(hf_dir: Path, path: Path, formats: dict[str, str] | None = None) -> Path:
    """Convert the tiny HF model in ``hf_dir`` (safetensors, config.json, SmolLM2's byte-level tokenizer) to the
    GGUF llama.cpp's converter writes for its architecture: float32 tensors, but those ``formats`` names
    (``write_fields``), e.g. ``{"ffn_gate_exps": "Q8_0"}`` for every layer's stacked expert gate rows."""
    from safetensors.torch import load_file

    raw = json.loads((hf_dir / "config.json").read_text())
    params = raw.get("rope_parameters") or {}  # transformers >= 5 writes rope settings here (Gemma 3: per layer type)
    params = params.get("full_attention", params)
    raw |= {"rope_theta": raw.get("rope_theta") or params.get("rope_theta", 10000.0),
            "partial_rotary_factor": raw.get("partial_rotary_factor") or params.get("partial_rotary_factor", 0.5),
            "rope_scaling": raw.get("rope_scaling") or (params if params.get("rope_type") != "default" else None)}
    arch = _ARCHS[raw["architectures"][0]]
    state = load_file(str(hf_dir / "model.safetensors"))
    fields = _hparams(raw, arch) | byte_level_fields(hf_dir / "tokenizer.json", "smollm")
    return write_fields(path, arch, fields, _tensors(raw, arch, state), formats)


def _format(name: str, formats: dict[str, str]) -> str | None:
    """The format ``formats`` gives GGUF tensor ``name``: by its name without ``.weight``, else by that name's last
    part (``blk.1.ffn_up_exps`` before ``ffn_up_exps``); None: float32."""
    stem = name.removesuffix(".weight")
    return formats.get(stem, formats.get(stem.rsplit(".", 1)[-1]))


def _hparams(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    out = {"context_length": raw["max_position_embeddings"], "embedding_length": raw["hidden_size"],
           "feed_forward_length": raw["intermediate_size"], "block_count": raw["num_hidden_layers"],
           "attention.head_count": heads, "attention.head_count_kv": raw["num_key_value_heads"],
           "attention.key_length": head_dim, "attention.value_length": head_dim,
           "attention.layer_norm_rms_epsilon": float(raw["rms_norm_eps"]),
           "rope.freq_base": float(raw.get("rope_theta") or 10000.0), "rope.dimension_count": head_dim}
    if arch in ("qwen3moe", "glm4moe"):
        out |= {"expert_count": raw.get("num_experts") or raw.get("num_local_experts") or raw["n_routed_experts"],
                "expert_used_count": raw["num_experts_per_tok"],
                "expert_feed_forward_length": raw["moe_intermediate_size"]}
    if arch == "glm4moe":
        out |= {"rope.dimension_count": int(head_dim * raw["partial_rotary_factor"]),
                "expert_shared_count": raw["n_shared_experts"],
                "leading_dense_block_count": raw["first_k_dense_replace"], "expert_gating_func": 2,
                "expert_weights_scale": float(raw["routed_scaling_factor"]),
                "expert_weights_norm": bool(raw["norm_topk_prob"])}
    if arch == "phi3":  # 0 for none (Phi-4); llama's converter writes no window
        out["attention.sliding_window"] = raw.get("sliding_window") or 0
    elif raw.get("sliding_window") and arch in ("gemma2", "gemma3"):
        out["attention.sliding_window"] = raw["sliding_window"]
    if arch == "gemma2":
        out |= {"attn_logit_softcapping": float(raw["attn_logit_softcapping"]),
                "final_logit_softcapping": float(raw["final_logit_softcapping"])}
    scaling = raw.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        out |= {"rope.scaling.type": "linear", "rope.scaling.factor": float(scaling["factor"])}
    if kind == "yarn" and scaling.get("factor") is not None:  # llama.cpp's TextModel.set_gguf_parameters
        out |= {"rope.scaling.type": "yarn", "rope.scaling.factor": float(scaling["factor"]),
                "rope.scaling.original_context_length": scaling["original_max_position_embeddings"]}
        for hf_key, key in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                            ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if scaling.get(hf_key) is not None:
                out[f"rope.scaling.{key}"] = float(scaling[hf_key])
    if arch == "phi3" and scaling:
        orig = raw.get("original_max_position_embeddings") or scaling["original_max_position_embeddings"]
        out |= {"rope.scaling.original_context_length": orig,
                "rope.scaling.attn_factor": math.sqrt(1 + math.log(raw["max_position_embeddings"] / orig)
                                                      / math.log(orig))}
    return {f"{arch}.{k}": v for k, v in out.items()}


def _tensors(raw: dict[str, Any], arch: str, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The GGUF tensors: llama.cpp's names (``gguf.get_tensor_name_map``), llama's Q/K rows permuted, Gemma's norms
    as 1 + w, experts stacked per layer, rope factors as tensors."""
    names = gguf.get_tensor_name_map(_MODEL_ARCH[arch],
                                     raw["num_hidden_layers"])
    out: dict[str, np.ndarray] = {}
    experts: dict[str, list[torch.Tensor]] = {}
    for name, w in state.items():
        w = w.float()
        if ".mlp.experts." in name:  # model.layers.N.mlp.experts.E.gate_proj.weight -> stacked per N and proj
            head, _, rest = name.partition(".mlp.experts.")
            experts.setdefault(f"{head}.mlp.experts.{rest.split('.', 1)[1]}", []).append(w)
            continue
        if name.endswith("e_score_correction_bias"):
            out[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = w.numpy()
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = raw["num_attention_heads"] if "q_proj" in name else raw["num_key_value_heads"]
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w.numpy()
    for name, ws in experts.items():  # per-expert tensors were listed in expert order
        out[names.get_name(name, try_suffixes=(".weight",))] = torch.stack(ws).numpy()
    out |= _rope_factor_tensors(raw, arch)
    return out


def _rope_factor_tensors(raw: dict[str, Any], arch: str) -> dict[str, np.ndarray]:
    """llama3 rope scaling as llama.cpp's ``rope_freqs`` factors; Phi-3's longrope as its long and short ones."""
    scaling = raw.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if arch == "phi3" and kind == "longrope":
        return {"rope_factors_long.weight": np.array(scaling["long_factor"], np.float32),
                "rope_factors_short.weight": np.array(scaling["short_factor"], np.float32)}
    if kind != "llama3":
        return {}
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (raw["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": np.array(factors, np.float32)}
