"""Structured output: each step, a mask of the tokens a grammar allows next (llguidance), so that the output
matches a JSON schema.

The router turns ``response_format`` into an llguidance grammar (``grammar_for``), refusing with a 400 one that
does not compile; the grammar travels in ``SamplingParams.grammar``. Every engine that samples the request (prefill
for the first token, decode for the rest) keeps a ``Guide`` for it: before each pick the sampler sets the logits of
forbidden tokens to -inf, after it the guide consumes the token, and once the grammar is complete the request
ends ("stop"). A row's mask depends only on its own tokens: batch invariance holds.

Why llguidance: on SmolLM2's 49,152-token vocabulary its mask costs tens of microseconds per token (bench/
sampling.py), a fraction of a percent of a decode step, and it is one wheel with no dependencies; xgrammar's masks
were faster still (mean 7 against 49 us on a 32-token JSON schema walk, Intel Xeon with AMX) but it needs
transformers and triton at run time.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from kvfence.core import InvalidRequest

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions  # a TypedDict of llguidance's stubs only

    from kvfence.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
MAX_SCHEMA_BYTES = 64 * 1024
# JSON laid out as json.dumps does: free whitespace lets a weak model pad forever (seen: 300 tokens of blanks after
# "{" from a small model); a schema's own "x-guidance" options override this.
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@lru_cache(maxsize=4)
def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    """llguidance's view of ``tokenizer`` with ``vocab_size`` logits (built once: ~0.2 s)."""
    return LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids))


def grammar_for(response_format: dict[str, Any] | None, tokenizer: Tokenizer) -> str | None:
    """The grammar ``response_format`` asks for (None for text), checked to compile: ``json_object`` is any JSON
    object, ``json_schema`` its ``schema``. ``InvalidRequest`` (param ``response_format``) otherwise."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        assert response_format is not None  # kind is not the default "text"
        schema = response_format["json_schema"].get("schema", {})
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"The JSON schema is too large (more than {MAX_SCHEMA_BYTES} bytes).",
                             param="response_format")
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as e:
        raise InvalidRequest(f"Invalid JSON schema in 'response_format': {e}", param="response_format") from None
    error = LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer, tokenizer.vocab_size))
    if error:
        raise InvalidRequest(f"The JSON schema in 'response_format' cannot be enforced: {error}",
                             param="response_format")
    return grammar


class Guide:
    """One request's grammar state: which tokens may come next, and whether the grammar is complete."""

    def __init__(self, grammar: str, tokenizer: LLTokenizer) -> None:
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise InvalidRequest(f"The grammar cannot be enforced: {self.matcher.get_error()}",
                                 param="response_format")

    def mask(self, row: torch.Tensor) -> None:  # the router imports this module without torch
        """Set the float32 CPU ``row``'s logits of every token the grammar forbids next to -inf (in place)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        row.numpy()[~bits[: row.numel()].astype(bool)] = -np.inf

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            log.warning("grammar refused token %d (%s); ending the request", token, self.matcher.get_error())

    @property
    def done(self) -> bool:
        """The grammar is complete (or broken): nothing but EOS may follow."""
        return self.matcher.is_stopped()
