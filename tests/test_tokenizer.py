"""Tokenizer: SmolLM2's GGUF tokenizer against transformers, chat templates, decoding and streaming.

About digits: the GGUF says ``tokenizer.ggml.pre = "smollm"``, which llama.cpp (and SmolLM2's own tokenizer.json on
the Hub) split as ``Digits(individual_digits) + ByteLevel``. transformers' GGUF converter has no entry for "smollm"
and falls back to plain GPT-2 splitting, so the two differ only where a whitespace run or a numeric character
touches a digit: transformers gives ``"  1"`` as ``Ġ Ġ 1``, the model's tokenizer as ``ĠĠ 1``. We follow the
model's tokenizer; ``test_digits_split_like_the_models_own_tokenizer`` pins that difference down.
"""

import jinja2
import pytest
from tokenizers import pre_tokenizers

from kvfence.model.loader import smollm2_gguf_path
from kvfence.model.tokenizer import Tokenizer
from tests.tiny_models import smollm2_tokenizer, tokenizer_files_dir

TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nend",
    "Ünïcödé façade naïve – “quotes” … ß ø",
    "日本語のテキストと中文，还有한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "digits 1234567890 and 3.14159, 1e-10, 0x1F, v2.0",
    "x = [1,2,3]\n\treturn x**2  # comment",
    "def f(a, b):\n    return {'k': a+b}\n",
    "   \n  \t ",
    "",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "I'm you're they'll it's WE'VE Don'T",
    "a" * 60,
    "https://example.com/path?q=1&r=2#frag",
    "price: $99.99!!! ... ---- ====",
    "<|endoftext|>stuff<repo_name>x<file_sep>",
    "\u00a0nbsp and \u200b zero width",
]
# where a whitespace run or a numeric character touches a digit (see the module docstring)
DIGIT_EDGES = ["  123", "a  42 b", "line\n 7", "x\n\n1", "ǅ Ⅻ ½ ² ٣", "    x = 10\n    y = 2"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 😀 and 日本."},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_hub_split(hf):
    """transformers' GGUF tokenizer with the pre-tokenizer of SmolLM2's tokenizer.json on the Hub."""
    import copy

    tok = copy.deepcopy(hf)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok


@pytest.mark.model
def test_encodings_match_transformers(ours, hf):
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text


@pytest.mark.model
def test_encodings_match_the_hub_pre_tokenizer_everywhere(ours, hf_hub_split):
    for text in TEXTS + DIGIT_EDGES:
        assert ours.encode(text) == hf_hub_split.encode(text, add_special_tokens=False), text


@pytest.mark.model
def test_digits_split_like_the_models_own_tokenizer(ours, hf):
    ids = ours.encode("  123")
    assert [ours.backend.id_to_token(i) for i in ids] == ["ĠĠ", "1", "2", "3"]
    assert hf.convert_ids_to_tokens(hf.encode("  123", add_special_tokens=False)) == ["Ġ", "Ġ", "1", "2", "3"]
    for text in DIGIT_EDGES:  # same text either way, only the segmentation differs
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.model
def test_special_tokens_map_to_ids_and_no_bos_is_added(ours):
    assert ours.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert ours.encode("hi")[0] != ours.bos_token_id and not ours.add_bos
    assert ours.eos_token_ids >= {2} and ours.eos_token == "<|im_end|>" and ours.vocab_size == 49152


@pytest.mark.model
def test_chat_template_matches_transformers(ours, hf):
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want


@pytest.mark.model
def test_decode_round_trip_and_special_tokens(ours):
    for text in TEXTS + DIGIT_EDGES:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


@pytest.mark.model
@pytest.mark.parametrize("text", ["emoji 😀👍🏽 ok", "中文和日本語のテキスト", "🇫🇷👨‍👩‍👧 end", "plain ascii"])
def test_incremental_detokenizer_streams_whole_characters(ours, text):
    ids = ours.encode(text)
    detok, deltas = ours.detokenizer(), []
    for i in ids:
        delta = detok.push(i)
        assert "\ufffd" not in delta  # partial UTF-8 is held back, never emitted
        deltas.append(delta)
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d) > 1


@pytest.mark.model
def test_incremental_detokenizer_holds_back_then_flushes(ours):
    emoji = ours.encode("😀")
    assert len(emoji) > 1  # a byte-level vocab spells it in pieces
    detok = ours.detokenizer()
    assert [detok.push(i) for i in emoji[:-1]] == [""] * (len(emoji) - 1)
    assert detok.flush() == "\ufffd"  # the stream ended mid-character


@pytest.mark.model
def test_incremental_detokenizer_uses_prompt_context(ours):
    prompt, reply = ours.encode("Say hi"), ours.encode(" there, friend")
    detok = ours.detokenizer(prompt_ids=prompt)
    assert "".join(detok.push(i) for i in reply) + detok.flush() == " there, friend"


@pytest.mark.model
def test_hf_dir_tokenizer_matches_gguf(ours):
    tok = Tokenizer.from_hf_dir(tokenizer_files_dir())
    for text in TEXTS + DIGIT_EDGES:
        assert tok.encode(text) == ours.encode(text), text
    assert tok.apply_chat_template(CONVERSATIONS[2]) == ours.apply_chat_template(CONVERSATIONS[2])
    assert 2 in tok.eos_token_ids and tok.bos_token == "<|im_start|>" and not tok.add_bos


@pytest.mark.model
def test_template_is_sandboxed_and_can_raise(ours):
    bad = Tokenizer(
        ours.backend,
        chat_template="{{ raise_exception('no system role') }}",
        bos_token=None,
        eos_token=None,
        eos_token_ids=[2],
    )
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        bad.apply_chat_template(CONVERSATIONS[0])
    sneaky = Tokenizer(
        ours.backend,
        chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}",
        bos_token=None,
        eos_token=None,
        eos_token_ids=[2],
    )
    with pytest.raises(jinja2.exceptions.SecurityError):
        sneaky.apply_chat_template(CONVERSATIONS[0])
