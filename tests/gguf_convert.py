"""A small HF -> GGUF converter for tests, following llama.cpp's ``convert_hf_to_gguf.py``: its tensor names, its
metadata keys, its Q/K row permutation for llama, its fused tensors for phi3, its ``+ 1`` on Gemma's norms and its
``rope_freqs`` factors for llama3 rope scaling. Tensors are written as float32 (``F32``), so what kvfence reads back
is exactly the HF weights.

``write_gguf(hf_dir, path)`` converts a tiny model directory (``tests/tiny_models.py``) with its byte-level BPE
tokenizer; ``sentencepiece_fields(model_file, kind)`` gives the ``tokenizer.ggml.*`` fields llama.cpp writes for a
SentencePiece model (``llama`` BPE or ``t5`` Unigram), and ``write_fields`` writes a GGUF of fields alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# -- tokenizers -----------------------------------------------------------------------------------------------------


def sentencepiece_fields(model_file: Path, kind: str) -> dict[str, Any]:
    """The tokenizer fields llama.cpp's ``_create_vocab_sentencepiece`` (``kind`` ``"llama"``) or its T5 converter
    (``"t5"``: plus the normalizer's precompiled charsmap) writes for a SentencePiece ``model_file``."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    proto = pb.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    types = []
    for i in range(sp.vocab_size()):
        types.append(gguf.TokenType.CONTROL if sp.IsControl(i) else gguf.TokenType.UNKNOWN if sp.IsUnknown(i)
                     else gguf.TokenType.UNUSED if sp.IsUnused(i) else gguf.TokenType.BYTE if sp.IsByte(i)
                     else gguf.TokenType.NORMAL)
    fields: dict[str, Any] = {
        "tokenizer.ggml.model": kind,
        "tokenizer.ggml.tokens": [sp.IdToPiece(i) for i in range(sp.vocab_size())],
        "tokenizer.ggml.scores": [sp.GetScore(i) for i in range(sp.vocab_size())],
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


def write_fields(path: Path, arch: str, fields: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write a GGUF of ``fields`` (typed as ``gguf.GGUFWriter`` types Python values: ints as int32 or uint32, floats
    as float32, bytes as uint8 arrays) and float32 ``tensors`` (HF-ordered shapes: the writer reverses them)."""
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
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
