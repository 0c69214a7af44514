"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, parsed strictly.

``parse_body`` turns raw bytes into a validated body or raises ``InvalidRequest`` (400) naming the param:

- the JSON must be UTF-8 and an object; ``NaN``, ``Infinity`` and numbers too large for a double (``1e400``)
  are refused wherever they appear, and so are strings that are not valid Unicode (a lone UTF-16 surrogate
  such as ``"\\ud800"``), in known and unknown fields alike: nothing a worker cannot encode gets past the edge;
- pydantic then checks shapes, types and ranges in strict mode: an integer must be a JSON integer, a boolean a
  JSON boolean, a string a JSON string (a float may be given as a JSON integer);
- an unknown field is a 400 naming it, as OpenAI answers ("Unrecognized request argument supplied"), vLLM and
  SGLang extensions included: a request is never answered while part of it was silently ignored;
- ``check()`` rejects what parses but cannot be honoured (``n > 1``, tools, ...) unless it has the value that
  means "off" (``NEUTRAL``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvfence.core import MAX_CHOICES, InvalidRequest, SamplingParams
from kvfence.router.tools import CLOSE, OPEN, ToolUse

STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a surrogate can enter valid UTF-8 JSON
_SURROGATE = re.compile("[\ud800-\udfff]")

B = TypeVar("B", bound="Body")
Number = float  # a JSON number; strict mode still takes a JSON integer for it
_INT64 = 2**63
_INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's top_logprobs and vLLM's default max_logprobs
MAX_LOGIT_BIAS = 1024  # entries


def parse_body(raw: bytes, schema: type[B]) -> B:
    """``raw`` as a valid ``schema``, or ``InvalidRequest`` naming the param (see the module docstring)."""
    data = strict_json(raw)
    try:
        body = schema.model_validate(data)
    except ValidationError as e:
        raise invalid_request(e.errors()) from None
    body.check()
    return body


def strict_json(raw: bytes) -> dict:
    """A JSON object whose every number is finite and every string valid Unicode; ``InvalidRequest`` otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"The request body is not valid UTF-8 (byte {e.start}).") from None
    non_finite = []

    def number(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            non_finite.append(literal)
        return value

    try:
        data = json.loads(text, parse_float=number, parse_constant=number)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"The request body is not valid JSON: {e.msg} (at character {e.pos}).") from None
    except RecursionError:
        raise InvalidRequest("The request body is not valid JSON: it is nested too deeply.") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise InvalidRequest(f"The request body is not valid JSON: {e}.") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    if non_finite or _SURROGATE_ESCAPE.search(raw):
        _refuse_invalid_leaf(data)
    return data


def _refuse_invalid_leaf(data: dict) -> None:
    """Raise ``InvalidRequest`` for the first non-finite number or invalid string (value or key) in ``data``."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequest(f"Invalid value for '{param_name(path)}': numbers must be finite "
                                 "(no NaN, Infinity, or values beyond the range of a double).", param=param_name(path))
        if isinstance(value, str) and _SURROGATE.search(value):
            raise InvalidRequest(f"Invalid value for '{param_name(path)}': the string is not valid Unicode "
                                 "(it holds a lone UTF-16 surrogate).", param=param_name(path))
        if isinstance(value, dict):
            for key in value:
                if _SURROGATE.search(key):
                    where = f"a key of '{param_name(path)}'" if path else "a key of the request body"
                    raise InvalidRequest(f"Invalid name: {where} is not valid Unicode (it holds a lone UTF-16 "
                                         "surrogate).", param=param_name(path) or None)
            stack += [((*path, k), v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [((*path, i), v) for i, v in reversed(list(enumerate(value)))]


def param_name(loc: tuple[str | int, ...] | list[str | int]) -> str:
    """A field's path as OpenAI-style ``param``: ``messages.[0].content``."""
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc)


def invalid_request(errors: list[Any]) -> InvalidRequest:
    """The first pydantic validation error as a 400 whose ``param`` names the field."""
    first = dict(errors[0]) if errors else {}
    loc = list(first.get("loc", ()))
    if not loc:
        return InvalidRequest("The request body must be a JSON object.")
    param = param_name(loc)
    if first.get("type") == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'.", param=param)
    if first.get("type") == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)  # OpenAI's words
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return InvalidRequest(f"Invalid value for '{param}': {msg}", param=param)


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
    model_config = STRICT

    include_usage: bool | None = False


class Body(BaseModel):
    """A request body ``parse_body`` reads: ``check`` rejects what its schema admits but cannot be served."""

    def check(self) -> None:
        pass


class GenerateBody(Body):
    """Fields both endpoints share. ``None`` always means "the default".

    Fields we know but do not implement are typed too, and ``check()`` accepts only the values in
    ``NEUTRAL`` for them (those that mean "off").
    """

    model_config = STRICT
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "best_of": (None, 1), "store": (None, False),
        "service_tier": (None, "auto", "default"), "metadata": (None, {}),
    }

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)  # extension; 0 or -1 means off
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)  # int64, as vLLM
    stop: Stop = ()
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extension
    user: str | None = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(None, gt=0, le=100)  # extension
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int | None = Field(None, ge=0, le=_INT32_MAX)  # extension
    min_p: Number | None = Field(None, ge=0, le=1)  # extension
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_INT32_MAX)]] | None = Field(None, max_length=256)  # extension
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # extension (vLLM's): scopes the prefix cache
    best_of: int | None = None
    store: bool | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None

    def check(self) -> None:
        """Reject, as ``InvalidRequest``, what parses but cannot be served."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"'n' must be between 1 and {MAX_CHOICES}; got {self.n}.", param="n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true.", param="stream_options")
        for name, neutral in self.NEUTRAL.items():
            if getattr(self, name) not in neutral:
                raise InvalidRequest(f"'{name}' is not supported by this server.", param=name)
        self.bias()

    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; its keys must be token ids written in decimal."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) > _INT32_MAX:
                raise InvalidRequest(f"Invalid key in 'logit_bias': {key[:40]!r} is not a token id.",
                                     param="logit_bias")
            pairs.append((int(key), float(value)))
        return tuple(sorted(pairs))

    @property
    def logprobs_wanted(self) -> int | None:
        """How many top logprobs each token carries; None when logprobs are off."""
        return None

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """The same for the prompt's tokens (echo with logprobs)."""
        return None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, grammar: str | None = None) -> SamplingParams:
        """The engine's view of this body, with ``max_tokens`` already settled by admission and the ``grammar``
        compiled from ``response_format``."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=self.stop,
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.bias(),
            min_tokens=self.min_tokens or 0,
            min_p=self.min_p or 0.0,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=self.logprobs_wanted,
            prompt_logprobs=self.prompt_logprobs_wanted,
            grammar=grammar,
            n=self.n or 1,
        )


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (output matching its ``schema``)."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict[str, Any]:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InvalidRequest("'response_format.json_schema' is required with type 'json_schema', and only then.",
                                 param="response_format.json_schema")
        schema = {"schema": self.json_schema.schema_} if self.json_schema else {}
        return {"type": self.type} | ({"json_schema": schema} if schema else {})


class FunctionDef(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


def _tool_choice(value: object) -> object:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError:
            pass
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': "
                     "NAME}}")


ToolChoice = Annotated[str | NamedToolChoice | None, BeforeValidator(_tool_choice)]


class CalledFunction(BaseModel):
    model_config = STRICT

    name: str
    arguments: str  # JSON text


class HistoryToolCall(BaseModel):
    """A call the assistant made earlier in the conversation."""

    model_config = STRICT

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: TextContent = ""
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[HistoryToolCall] | None = None
    refusal: str | None = None

    def for_template(self, knows_tools: bool = False) -> dict[str, Any]:
        """The message as a chat template expects it (``developer`` is the newer name for ``system``); ``name``
        and ``tool_call_id`` go to the template too. Earlier tool calls go as ``tool_calls`` (arguments as
        objects) to a template that ``knows_tools``, else as ``<tool_call>`` blocks in the content, and a tool
        result in ``<tool_response>`` tags."""
        extra: dict[str, Any] = {k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id))
                                 if v is not None}
        content = self.content
        if self.tool_calls and knows_tools:
            extra["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        elif self.tool_calls:
            blocks = [json.dumps({"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                                 ensure_ascii=False) for c in self.tool_calls]
            calls = [f"{OPEN}\n{b}\n{CLOSE}" for b in blocks]
            content = "\n".join([content, *calls] if content else calls)
        elif self.role == "tool" and not knows_tools:
            content = f"<tool_response>\n{content}\n</tool_response>"
        return {"role": "system" if self.role == "developer" else self.role, "content": content, **extra}


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(GenerateBody):
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = GenerateBody.NEUTRAL | {
        "functions": (None, []), "function_call": (None, "none", "auto"),
        "modalities": (None, ["text"]), "reasoning_effort": (None,), "audio": (None,), "prediction": (None,),
        "web_search_options": (None,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    functions: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        if self.response_format is not None:
            self.response_format.as_dict()
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise InvalidRequest("tool_choice needs tools.", param="tool_choice")
        uses = self.tool_use()
        if uses is not None and uses.grammar() is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise InvalidRequest("A required tool call and a response_format cannot be combined.",
                                 param="response_format")

    def tool_use(self) -> ToolUse | None:
        """The tools and how they may be used; None without tools."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        return ToolUse([t.model_dump(exclude_none=True) for t in self.tools],
                       choice if isinstance(choice, str) else choice.model_dump(),
                       self.parallel_tool_calls is not False)

    @property
    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerateBody):
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = GenerateBody.NEUTRAL | {
        "suffix": (None, "")}

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None

    @property
    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None


class TokenizeRequest(Body):
    """``POST /tokenize`` in vLLM's shape: a ``prompt`` as is, or ``messages`` through the chat template, as the
    completion endpoints would see them."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # False: no BOS, even where the model asks for one
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("Give either 'prompt' or 'messages'.", param="prompt")


class PublishPrefixRequest(Body):
    """``POST /admin/prefixes``: a ``prompt`` as a completion would see it, or ``messages`` through the chat
    template without a generation prompt (a chat's opening, as every chat that starts with it renders it)."""

    model_config = STRICT

    model: str | None = None
    prompt: str | list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("Give either 'prompt' or 'messages'.", param="prompt")


class DetokenizeRequest(Body):
    """``POST /detokenize`` in vLLM's shape."""

    model_config = STRICT

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
