"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``.

Pydantic checks shapes and ranges; a failure becomes a 400 whose ``param``
names the field (see ``app.py``). ``check()`` then rejects what parses but
cannot be honoured (``n > 1``, logprobs, tools, penalties, ...): a 400 is
better than an answer that silently ignores part of the request. Unknown
fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from kvfence.core import InvalidRequest, SamplingParams

# Fields we know but do not implement, with the values that mean "off".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "min_tokens": (None, 0),
}


def _stop_tuple(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if not all(stops):
        raise ValueError("stop strings must not be empty")
    return tuple(stops)


def _text_content(value: object) -> str:
    """Message content as one string: a string, null, or a list of text parts (joined by newlines)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("content must be a string or a list of content parts")
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"content part type {kind!r} is not supported; only {{'type': 'text', 'text': ...}}")
        texts.append(part["text"])
    return "\n".join(texts)


def _one_prompt(value: object) -> str | list[int]:
    """A completion prompt: a string or token ids, or a list holding exactly one of those."""
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        if len(value) != 1:
            raise ValueError("only one prompt per request is supported")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ValueError("the prompt is empty")
        return value
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise ValueError("prompt must be a string or a list of token ids")
    if not value:
        raise ValueError("the prompt is empty")
    if min(value) < 0:
        raise ValueError("token ids must not be negative")
    return value


Stop = Annotated[tuple[str, ...], BeforeValidator(_stop_tuple)]
TextContent = Annotated[str, BeforeValidator(_text_content)]
Prompt = Annotated[str | list[int], BeforeValidator(_one_prompt)]


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class GenerateBody(BaseModel):
    """Fields both endpoints share. ``None`` always means "the default"."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension; 0 or -1 means off
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # int64, as vLLM
    stop: Stop = ()
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extension
    user: str | None = None

    def check(self) -> None:
        """Reject, as ``InvalidRequest``, what parses but cannot be served."""
        if self.n not in (None, 1):
            raise InvalidRequest("Only n=1 is supported.", param="n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true.", param="stream_options")
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
                raise InvalidRequest(f"'{name}' is not supported by this server.", param=name)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's view of this body, with ``max_tokens`` already settled by admission."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=self.stop,
            ignore_eos=bool(self.ignore_eos),
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: accepted, not used

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: TextContent = ""

    def for_template(self) -> dict[str, str]:
        """The message as a chat template expects it; ``developer`` is the newer name for ``system``."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(GenerateBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerateBody):
    prompt: Prompt
