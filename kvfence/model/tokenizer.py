"""Tokenizer: text <-> token ids, chat templates, and streaming detokenization.

Built either from a GGUF's metadata or from an HF directory's ``tokenizer.json``. A GGUF's
``tokenizer.ggml.model`` is one of llama.cpp's: ``gpt2`` (byte-level BPE, split first as its ``tokenizer.ggml.pre``
says: an unknown or missing one is refused), ``llama`` (SentencePiece BPE: the highest-scoring pair merges first,
unknown characters fall back to ``<0xNN>`` byte tokens) or ``t5`` (SentencePiece Unigram: the best-scoring
segmentation, Viterbi over the scores). Encoding never adds special tokens other than a BOS the model asks for;
special tokens written in the text (``<|im_start|>``) map to their ids.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE, Unigram

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6
_SPACE = "\u2581"  # SentencePiece's spelling of a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token

# GGUF `tokenizer.ggml.pre` -> how text is split before BPE; every name here is what llama.cpp's
# convert script writes for a known HF tokenizer.json, and the splits reproduce that tokenizer.json.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")  # HF: Digits(individual) + ByteLevel
_REGEX_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                 "deepseek-r1-qwen": _QWEN2_SPLIT}
_GPT2_SPLIT = ("gpt2", "gpt-2")  # GPT-2's own split (ByteLevel's regex)

# Token texts llama.cpp also treats as end of generation when the vocab marks them as control tokens.
_EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>")


class Tokenizer:
    """Encode, decode and render chat prompts for one model.

    Contract: ``encode`` adds no special tokens except BOS when the model's metadata asks for it (and the text
    does not start with BOS already); ``eos_token_ids`` holds every id that ends generation.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: Iterable[int],
        add_bos: bool = False,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.add_bos = add_bos and self.bos_token_id is not None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None
        self._token_bytes: dict[int, bytes] = {}
        # SentencePiece pieces spell a space as U+2581 and a fallback byte as <0xNN>, whatever the decoder strips
        self._sentencepiece = isinstance(backend.model, Unigram) or getattr(backend.model, "byte_fallback", False)

    # -- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata already read into a dict (``tokenizer.ggml.*`` keys); ValueError, naming what
        is supported, for another tokenizer model or a ``gpt2`` one whose pre-tokenizer is unknown or missing."""
        model = meta.get("tokenizer.ggml.model")
        build = _GGUF_MODELS.get(model) if isinstance(model, str) else None
        if build is None:
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE, "
                             "'llama' SentencePiece BPE, 't5' SentencePiece Unigram)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        backend = build(meta, tokens, types)
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _USER_DEFINED
            ]
        )

        def tok(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        eos_ids = {
            meta[f"tokenizer.ggml.{k}"]
            for k in ("eos_token_id", "eot_token_id", "eom_token_id")
            if f"tokenizer.ggml.{k}" in meta
        }
        eos_ids |= {
            i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == _CONTROL and t in _EOG_TEXTS
        }
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=tok("bos_token_id"),
            eos_token=tok("eos_token_id"),
            eos_token_ids=eos_ids,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from ``tokenizer.json``, plus ``tokenizer_config.json`` (bos/eos, chat template, add_bos),
        ``chat_template.jinja`` and ``generation_config.json`` (eos ids) when present."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (a fast-tokenizer file is required)")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        eos_id = backend.token_to_id(eos) if eos else None
        eos_ids: set[int] = {eos_id} if eos_id is not None else set()
        for source in (gen, _read_json(path / "config.json")):  # generation_config first; config.json as a fallback
            more = source.get("eos_token_id")
            eos_ids |= set(more if isinstance(more, list) else [more] if more is not None else [])
            if eos_ids:
                break
        # A post-processor that prepends BOS (Llama 3) shows up as a non-empty encoding of "".
        bos_prefix = backend.encode("", add_special_tokens=True).ids
        if bos is None and len(bos_prefix) == 1:
            bos = backend.id_to_token(bos_prefix[0])
        add_bos = cfg.get("add_bos_token", len(bos_prefix) == 1)
        return cls(
            backend,
            chat_template=_hf_chat_template(path, cfg),
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=eos_ids,
            add_bos=add_bos,
        )

    # -- encode / decode ------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens in the text map to their ids; BOS only if the model asks for it."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, even where they are part of a UTF-8 character (byte-level BPE spells
        each byte as one character of its vocabulary, SentencePiece as a ``<0xNN>`` token), a SentencePiece space
        as a space; special tokens as their text."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            piece = self.backend.id_to_token(token_id) or ""
            byte = _BYTE_PIECE.fullmatch(piece)
            if isinstance(self.backend.decoder, decoders.ByteLevel) and all(c in _BYTE_OF_CHAR for c in piece):
                cached = bytes(_BYTE_OF_CHAR[c] for c in piece)
            elif self._sentencepiece and byte:
                cached = bytes([int(byte.group(1), 16)])
            elif self._sentencepiece:
                cached = piece.replace(_SPACE, " ").encode()
            else:
                cached = self.decode([token_id], skip_special_tokens=False).encode()
            self._token_bytes[token_id] = cached
        return cached

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer; ``prompt_ids`` (optional) give context for the first tokens' spacing."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    # -- chat -----------------------------------------------------------------------------------------------

    def set_chat_template(self, template: str) -> None:
        """Render chats with ``template`` instead of the model's own (``--chat-template``); checked here, so a
        template with a syntax error stops the server at start."""
        self._template = _jinja_env().from_string(template)
        self.chat_template = template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the model's own template (sandboxed jinja2, HF-compatible globals)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Contract: the concatenation of every ``push`` result and the final ``flush`` equals
    ``tokenizer.decode(all_ids)`` for byte-level tokenizers. Text that ends in an incomplete UTF-8 sequence
    (decodes to a trailing U+FFFD) is held back until a later token completes it or ``flush`` is called.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])  # a few tokens of context, never emitted
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def push(self, new_ids: int | Sequence[int]) -> str:
        """Append ``new_ids``; return the text they complete (may be empty)."""
        self.ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (incomplete bytes become U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


# -- helpers ------------------------------------------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes as characters (GPT-2's): printable Latin-1 bytes stand for themselves,
    the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(rest)}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], types: Sequence[int]) -> Backend:
    """llama.cpp's ``gpt2`` model: byte-level BPE over the file's merges, after the split its ``pre`` names."""
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = Backend(BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: Sequence[int]) -> Backend:
    """llama.cpp's ``llama`` model (``llm_tokenizer_spm``): spaces become U+2581 (one prepended unless
    ``add_space_prefix`` is false), then the adjacent pair whose joined piece scores highest merges, leftmost first,
    until none joins into a normal piece; a character left without a piece becomes its UTF-8 bytes' ``<0xNN>``
    tokens. As HF BPE: merges ranked by the joined piece's score. Two different pieces of one score would merge in
    rank order rather than leftmost first; SentencePiece's scores are distinct."""
    scores: Sequence[float] = meta["tokenizer.ggml.scores"]
    vocab = _vocab(tokens)
    ranked = []  # (-score of the joined piece, its id, split point, left, right)
    for i, (piece, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = BPE(vocab=vocab, merges=[(left, right) for *_, left, right in ranked], fuse_unk=True, byte_fallback=True,
              unk_token=tokens[unk] if unk is not None else None)
    return _with_spaces(Backend(bpe), meta, merge_spaces=False)


def _sentencepiece_unigram(meta: dict[str, Any], tokens: list[str], types: Sequence[int]) -> Backend:
    """llama.cpp's ``t5`` model (``llm_tokenizer_ugm``): the text normalized by the file's SentencePiece charsmap,
    runs of spaces merged where ``remove_extra_whitespaces``, spaces as U+2581, then the segmentation whose pieces'
    scores sum highest (Viterbi); an unknown character is the unknown token (scored 10 below the lowest piece)."""
    if meta.get("tokenizer.ggml.treat_whitespace_as_suffix"):
        raise ValueError("GGUF t5 tokenizer with treat_whitespace_as_suffix is not supported")
    scores: Sequence[float] = meta["tokenizer.ggml.scores"]
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    byte_fallback = _BYTE in types
    backend = Backend(Unigram([(t, float(s)) for t, s in zip(tokens, scores, strict=True)], unk, byte_fallback))
    return _with_spaces(backend, meta, merge_spaces=bool(meta.get("tokenizer.ggml.remove_extra_whitespaces")))


def _with_spaces(backend: Backend, meta: dict[str, Any], merge_spaces: bool) -> Backend:
    """A SentencePiece model's normalizer and decoder: the charsmap if the file has one; where ``merge_spaces``,
    no space at either end and one in each run of them, and a space before the text; else a space before the text
    unless ``add_space_prefix`` is false; every space spelled U+2581. Decoding undoes it (bytes fused, the first
    space dropped where one was prepended)."""
    steps: list[normalizers.Normalizer] = []
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        steps.append(normalizers.Precompiled(bytes(b & 0xFF for b in charsmap)))
    if merge_spaces:
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    prefix = merge_spaces or bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if prefix:
        steps.append(normalizers.Prepend(" "))
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return backend


_GGUF_MODELS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe, "t5": _sentencepiece_unigram}


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Each piece's id; a piece listed twice keeps its first id (as llama.cpp's ``token_to_id``)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    return vocab


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer HF's own tokenizer.json uses for the vocabulary llama.cpp calls ``pre``; ValueError for a
    name not known here (or none): a wrong split gives other tokens than the model was trained on."""
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _GPT2_SPLIT:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    known = ", ".join(sorted([*_DIGITS_THEN_GPT2, *_REGEX_SPLITS, *_GPT2_SPLIT]))
    raise ValueError(f"GGUF BPE pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported (supported: {known})")


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """A sandboxed environment with the globals and filters HF templates expect."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(tok: str | dict | None) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _hf_chat_template(path: Path, cfg: dict) -> str | None:
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in tpl}
        return named.get("default", next(iter(named.values()), None))
    return tpl
