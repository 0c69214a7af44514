"""Model: loading (GGUF, HF safetensors), tokenizer, and the forward over paged KV."""

from kvfence.model.llama import Model, SeqChunk
from kvfence.model.loader import LoadedModel, load_model
from kvfence.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "LoadedModel", "Model", "SeqChunk", "Tokenizer", "load_model"]
