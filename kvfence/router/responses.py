"""OpenAI response bodies and stream chunks for chat and text completions.

A ``Format`` turns engine text into the endpoint's JSON. It does not look at
the engine; ``app.py`` decides what to send and when.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import msgspec

from kvfence.core import FinishReason, TokenLogprob
from kvfence.router.tools import ToolCall

_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def sse(event: dict) -> bytes:
    """One server-sent event carrying ``event`` as JSON."""
    return b"data: " + _encode(event) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens read from the tenant's prefix cache, not computed."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, the same shape as ``KvfenceError.to_body()``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def finish_with_calls(finish: FinishReason, called: bool) -> FinishReason:
    """A stop whose text held tool calls is reported as ``tool_calls``."""
    return FinishReason.TOOL_CALLS if called and finish is FinishReason.STOP else finish


@dataclass(frozen=True)
class Tokens:
    """Generated tokens with their logprobs (one each, when the request asked), and where their text starts in
    the completion (``offset``, in characters: the legacy format's ``text_offset``)."""

    ids: list[int]
    logprobs: Sequence[TokenLogprob | None] = ()  # None: the prompt's first token (echo), which has none
    offset: int = 0


NO_TOKENS = Tokens([])


@dataclass(frozen=True)
class Format:
    """The shape of one endpoint's responses; ``id`` and ``created`` are fixed per request. ``token_bytes`` spells
    a token id, for logprobs."""

    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool = False
    token_bytes: Callable[[int], bytes] | None = None

    @classmethod
    def for_request(cls, chat: bool, rid: int, created: int, model: str, include_usage: bool,
                    token_bytes: Callable[[int], bytes] | None = None) -> Format:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, f"{prefix}{rid:032x}", created, model, include_usage, token_bytes)

    def completion(self, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                   cached_tokens: int = 0) -> dict:
        """The whole (non-streaming) response, from ``choice``'s dicts; usage counts the prompt once."""
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices) | {"usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def choice(self, index: int, text: str | None, finish: FinishReason, tokens: Tokens = NO_TOKENS,
               calls: Sequence[ToolCall] = ()) -> dict:
        """One choice of the whole response; ``calls``: the tool calls read from the text (``text`` is what
        remains, None when nothing does)."""
        finish = finish_with_calls(finish, bool(calls))
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": index,
                      "message": message | ({"tool_calls": [c.as_dict() for c in calls]} if calls else {})}
        else:
            choice = {"index": index, "text": text}
        return choice | {"logprobs": self._logprobs(tokens), "finish_reason": finish.value}

    def opening(self, index: int = 0) -> list[dict]:
        """Chunks sent before any text of choice ``index``: chat announces the assistant role with empty content."""
        return [self._chunk({"role": "assistant", "content": ""}, None, index=index)] if self.chat else []

    def delta(self, text: str, tokens: Tokens = NO_TOKENS, index: int = 0) -> dict:
        return self._chunk({"content": text} if self.chat else text, None, self._logprobs(tokens), index)

    def tool_call(self, number: int, call: ToolCall, index: int = 0) -> dict:
        """A chat chunk carrying one whole tool call of choice ``index`` (``number``: its place among the choice's
        calls)."""
        return self._chunk({"tool_calls": [call.as_dict(number)]}, None, index=index)

    def finish(self, finish: FinishReason, index: int = 0) -> dict:
        return self._chunk({} if self.chat else "", finish.value, index=index)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, only usage."""
        return self._envelope(self._chunk_object, []) | {"usage": usage(prompt_tokens, completion_tokens,
                                                                         cached_tokens)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, delta: dict | str, finish: str | None, logprobs: dict | None = None, index: int = 0) -> dict:
        choice: dict[str, object] = {"index": index, "delta": delta} if self.chat else {"index": index, "text": delta}
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        chunk = self._envelope(self._chunk_object, [choice])
        return chunk | {"usage": None} if self.include_usage else chunk

    def _logprobs(self, tokens: Tokens) -> dict | None:
        """The choice's ``logprobs``: chat's ``content`` list, or the legacy completions' four parallel lists."""
        if self.token_bytes is None:
            return None
        spell = self.token_bytes
        pairs = list(zip(tokens.ids, tokens.logprobs, strict=True))
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                raw = spell(token)
                return {"token": raw.decode(errors="replace"), "logprob": logprob, "bytes": list(raw)}

            def content(token: int, lp: TokenLogprob | None) -> dict:
                assert lp is not None  # only an echoed prompt's first token has none, and chat does not echo
                return entry(token, lp.logprob) | {"top_logprobs": [entry(*top) for top in lp.top]}

            return {"content": [content(t, lp) for t, lp in pairs], "refusal": None}
        texts = [spell(t).decode(errors="replace") for t in tokens.ids]
        offsets = list(accumulate([len(s) for s in texts], initial=tokens.offset))[:-1]
        return {"tokens": texts, "token_logprobs": [lp and lp.logprob for _, lp in pairs],
                "top_logprobs": [lp and {spell(t).decode(errors="replace"): v for t, v in lp.top} for _, lp in pairs],
                "text_offset": offsets}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
