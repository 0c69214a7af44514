"""GGUF tokenizers beyond byte-level BPE: llama.cpp's ``llama`` (SentencePiece BPE with byte fallback) and ``t5``
(SentencePiece Unigram), each against the ``sentencepiece`` library on models it trains here, written to a GGUF
as llama.cpp's converter writes them (``tests/gguf_convert.py``) and read back: among them a ``llama`` one as
Gemma's, with user-defined pieces for runs of spaces, tabs and newlines and no space prefix. And a byte-level BPE
GGUF whose pre-tokenizer is unknown or missing is refused, not guessed.
"""

from __future__ import annotations

import pytest

from kvfence.model.gguf_file import read_gguf
from kvfence.model.tokenizer import Tokenizer
from tests.gguf_convert import byte_level_fields, sentencepiece_fields, write_fields
from tests.test_model import varied_text
from tests.test_tokenizer import DIGIT_EDGES, TEXTS
from tests.tiny_models import tokenizer_files_dir

spm = pytest.importorskip("sentencepiece")

# unicode, digits, whitespace runs, emoji, and characters the training text never had (byte fallback / unknown)
STRINGS = [*TEXTS, *DIGIT_EDGES, "  two leading", "trailing two  ", "a\u3000b", "Ω≈ç√∫˜µ≤≥÷ 𝔘𝔫𝔦",
           "x" * 3 + " " * 9 + "y", "ÀÉÎÕÜ àéîõü ÅÆØ", "tab\there", "ﬁ ligature ①②③ ｆｕｌｌｗｉｄｔｈ", "🙂" * 5]
# runs of 1 to 9 spaces, tabs and newlines: alone, between words, leading, trailing, after a tag; and mixed
WHITESPACE = [text.format(ws * n) for n in range(1, 10) for ws in (" ", "\t", "\n")
              for text in ("a{}b", "{}x", "x{}", "{}", "x {}y", "<h1>{}T</h1>")] + [
    "def f():\n        return  1\n\n\n\tx =\t\t2", "a \t \n  b", " \n \n", "  <h1>  x  </h1>  ", "\t \t  \n   \n"]
# Gemma's user-defined pieces (its vocabulary has runs up to 31 of each, and more tags)
GEMMA_PIECES = [ws * n for ws in ("\u2581", "\t", "\n") for n in range(1 if ws == "\n" else 2, 9)] + ["<h1>", "</h1>"]
TRAINING = [
    *(varied_text(40, seed=i) for i in range(60)),
    "Ünïcödé façade naïve – “quotes” … ß ø ÀÉÎÕÜ àéîõü",
    "日本語のテキストと中文，还有한국어 日本 中文 한국어",
    "def f(a, b):\n    return {'k': a+b}\n    x = [1,2,3]",
    "digits 1234567890 and 3.14159, 1e-10, 0x1F, v2.0 2026-12-06",
    "emoji 😀👍 and more 😀 text",
]
# (tokenizer.ggml.model, sentencepiece training options): BPE as Llama's (identity normalization, spaces kept,
# digits split, byte fallback); Unigram as T5's (NFKC, extra spaces removed, unknown characters), and with bytes
KINDS = {
    "llama": dict(model_type="bpe", vocab_size=900, byte_fallback=True, normalization_rule_name="identity",
                  remove_extra_whitespaces=False, split_digits=True, character_coverage=0.995),
    "t5": dict(model_type="unigram", vocab_size=700, character_coverage=0.995),
    "t5-bytes": dict(model_type="unigram", vocab_size=700, byte_fallback=True, character_coverage=0.995),
    "gemma": dict(model_type="bpe", vocab_size=900, byte_fallback=True, normalization_rule_name="identity",
                  remove_extra_whitespaces=False, add_dummy_prefix=False, split_digits=True,
                  character_coverage=0.995, user_defined_symbols=GEMMA_PIECES),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Per kind: (sentencepiece processor, our tokenizer from the GGUF written with llama.cpp's fields)."""
    out = {}
    root = tmp_path_factory.mktemp("spm")
    for kind, options in KINDS.items():
        prefix = root / kind
        spm.SentencePieceTrainer.train(sentence_iterator=iter(TRAINING * 3), model_prefix=str(prefix),
                                       hard_vocab_limit=False, minloglevel=2, **options)
        model = prefix.with_suffix(".model")
        fields = sentencepiece_fields(model, "t5" if kind.startswith("t5") else "llama")
        meta = read_gguf(write_fields(root / f"{kind}.gguf", "llama", fields)).metadata
        out[kind] = spm.SentencePieceProcessor(model_file=str(model)), Tokenizer.from_gguf_fields(meta)
    return out


@pytest.mark.model
@pytest.mark.parametrize("kind", KINDS)
def test_sentencepiece_encodings_match_the_sentencepiece_library(trained, kind):
    sp, ours = trained[kind]
    fallback = 0
    for text in STRINGS + WHITESPACE:
        want = sp.encode(text)
        assert ours.encode(text) == want, (text, [sp.id_to_piece(i) for i in want])
        if not any(sp.is_unknown(i) for i in want):  # sentencepiece spells the unknown token " ⁇ "
            assert ours.decode(want) == sp.decode(want), text
        fallback += any(sp.is_byte(i) or sp.is_unknown(i) for i in want)
    assert fallback >= 5  # the strings do reach characters the vocabulary lacks


@pytest.mark.model
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_sentencepiece_bpe_token_bytes_spell_the_text(trained, kind):
    """Byte-fallback tokens are their byte, U+2581 a space and a user-defined piece its text: a text's token bytes
    are its UTF-8 bytes (after the one prepended space, where the model prepends one)."""
    sp, ours = trained[kind]
    prefix = " " if kind == "llama" else ""
    for text in STRINGS + WHITESPACE:
        if text:
            assert b"".join(ours.token_bytes(i) for i in ours.encode(text)) == (prefix + text).encode(), text


@pytest.mark.model
def test_gemma_whitespace_runs_are_its_user_defined_pieces(trained):
    """The GGUF spells Gemma's pieces with bare spaces and types them user-defined (4), as llama.cpp's converter
    writes them; a run of spaces, tabs or newlines is cut into them longest first, left to right, as sentencepiece
    and llama.cpp (which splits user-defined pieces out of the raw text before its merges) cut it."""
    sp, ours = trained["gemma"]
    user_defined = {sp.piece_to_id(p) for p in GEMMA_PIECES}
    assert {ours.backend.id_to_token(i) for i in user_defined} == {p.replace("\u2581", " ") for p in GEMMA_PIECES}
    eight, two = sp.piece_to_id("\u2581" * 8), sp.piece_to_id("\u2581" * 2)
    assert ours.encode("a" + " " * 18 + "b") == [sp.piece_to_id("a"), eight, eight, two, sp.piece_to_id("b")]
    ids = ours.encode("a\n\n\n\t\tb")
    assert ids == sp.encode("a\n\n\n\t\tb") and ids[1:3] == [sp.piece_to_id("\n\n\n"), sp.piece_to_id("\t\t")]
    assert sum(i in user_defined for text in WHITESPACE for i in ours.encode(text)) > 100


@pytest.mark.model
def test_sentencepiece_special_tokens_and_bos(trained, tmp_path):
    """Control tokens in the text map to their ids; a ``llama`` tokenizer adds BOS where the file asks."""
    sp, ours = trained["llama"]
    assert ours.encode("<s>hi</s>") == [sp.bos_id(), *sp.encode("hi"), sp.eos_id()]
    assert ours.decode([sp.bos_id(), *sp.encode("hi there")]) == "hi there"
    (tmp_path / "m.model").write_bytes(sp.serialized_model_proto())
    fields = sentencepiece_fields(tmp_path / "m.model", "llama") | {"tokenizer.ggml.add_bos_token": True,
                                                                   "tokenizer.ggml.bos_token_id": sp.bos_id()}
    assert Tokenizer.from_gguf_fields(fields).encode("hi") == [sp.bos_id(), *sp.encode("hi")]


@pytest.mark.model
def test_byte_level_pre_tokenizer_unknown_or_missing_is_refused():
    fields = byte_level_fields(tokenizer_files_dir() / "tokenizer.json", "smollm")
    assert Tokenizer.from_gguf_fields(fields).encode("x = 12") == Tokenizer.from_hf_dir(tokenizer_files_dir()).encode(
        "x = 12")
    with pytest.raises(ValueError, match=r"pre-tokenizer \(tokenizer.ggml.pre\) 'jais' is not supported .*smollm"):
        Tokenizer.from_gguf_fields(fields | {"tokenizer.ggml.pre": "jais"})
    with pytest.raises(ValueError, match="tokenizer.ggml.pre.* None is not supported"):
        Tokenizer.from_gguf_fields({k: v for k, v in fields.items() if k != "tokenizer.ggml.pre"})


@pytest.mark.fast
def test_unknown_tokenizer_model_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="'rwkv' is not supported .*'gpt2'.*'llama'.*'t5'"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "rwkv"})
