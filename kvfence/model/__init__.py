"""Model: loading (GGUF, HF safetensors), tokenizer, and the forward over paged KV (``llama.py``, ``backends/``).

The names below load on first use, so importing a torch-free submodule (``describe``, ``tokenizer``,
``gguf_file``: what the router uses) does not import torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfence.model.batch import SeqChunk
    from kvfence.model.llama import Model
    from kvfence.model.loader import LoadedModel, load_model
    from kvfence.model.tokenizer import IncrementalDetokenizer, Tokenizer

_HOMES = {
    "IncrementalDetokenizer": "tokenizer",
    "LoadedModel": "loader",
    "Model": "llama",
    "SeqChunk": "batch",
    "Tokenizer": "tokenizer",
    "load_model": "loader",
}
__all__ = ["IncrementalDetokenizer", "LoadedModel", "Model", "SeqChunk", "Tokenizer", "load_model"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
