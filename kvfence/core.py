"""Requests, sampling parameters and the errors every role speaks.

Errors carry their HTTP status and OpenAI error fields, so whichever role
raises one, the router can hand it to the client unchanged.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass, field, replace
from enum import StrEnum


def new_request_id() -> int:
    """A 128-bit random request id: the owner stamped on every KV page."""
    return secrets.randbits(128)


MAX_CHOICES = 16  # the most choices (``n``) one request may ask for


def branch_rid(rid: int, index: int) -> int:
    """The id of choice ``index`` of request ``rid``: ``rid`` itself for choice 0, else a hash of both (the owner
    stamped on that choice's own KV pages)."""
    if index == 0:
        return rid
    digest = hashlib.blake2b(rid.to_bytes(16, "big") + index.to_bytes(2, "big"), digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


class KvfenceError(Exception):
    """An error with an HTTP status and OpenAI error-body fields."""

    status: int = 500
    type: str = "internal_error"
    code: str | None = None
    layer: str | None = None  # the safety layer that decided, e.g. "admission" (for the audit log and metrics)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 layer: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if layer is not None:
            self.layer = layer

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(KvfenceError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"
    layer = "admission"

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, what: str = "context length") -> None:
        super().__init__(
            f"This model's maximum {what} is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            param="messages",
        )
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit


class AuthenticationError(KvfenceError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(KvfenceError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class TooManyRequests(KvfenceError):
    """429 in OpenAI's shape (``type`` "requests" or "tokens", ``code`` rate_limit_exceeded, as OpenAI's own rate
    limits), with a ``Retry-After`` header: whole seconds until the request would fit, at least 1.

    ``reason`` says which limit refused it (for metrics): ``tenant_queue_full``, ``server_queue_full``,
    ``tokens_per_minute`` or ``tokenization_backlog``.
    """

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float = 1.0, reason: str = "rate_limited",
                 kind: str = "requests") -> None:
        super().__init__(message)
        self.type, self.reason = kind, reason
        self.retry_after = max(1, math.ceil(retry_after))
        self.headers = {"Retry-After": str(self.retry_after)}


class ServiceUnavailable(KvfenceError):
    status = 503
    type = "service_unavailable"


class IntegrityError(KvfenceError):
    """A KV page failed verification (owner, epoch, coverage or checksum)."""

    status = 500
    type = "internal_error"
    code = "kv_integrity"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and min_p 0 mean off.

    The logits pass, in order: repetition penalty (on every token of the prompt and the output so far, as
    vLLM), presence and frequency penalties (output tokens only), ``logit_bias``, the ban on end tokens (EOS
    unless ``ignore_eos``, and ``stop_token_ids``) while fewer than ``min_tokens`` were generated, and the
    ``grammar``'s mask (an llguidance grammar, for structured output: ``engine/grammar.py``); then temperature,
    top-k, top-p and min-p pick the token. ``logprobs`` (k >= 0) asks for the chosen token's log-probability
    and the k most likely, from the model's raw logits (before any of the above, vLLM's default);
    ``prompt_logprobs`` the same for every prompt token after the first (what echo with logprobs shows).

    ``n`` choices share one prefill of the prompt; choice i samples with its own generator, seeded ``seed + i``
    when a ``seed`` is given (so choice i is what ``n=1`` with ``seed + i`` gives).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: off; k: the chosen token's and the top k's
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's (from the second on) and the top k's
    grammar: str | None = None  # llguidance grammar the output must match (structured output)
    n: int = 1  # choices: sequences sampled from one prefill of the prompt

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def shapes_logits(self) -> bool:
        """Whether any penalty, bias or ban applies before the pick (else the raw logits decide)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.grammar is not None)

    def with_max_tokens(self, n: int) -> SamplingParams:
        return replace(self, max_tokens=n)


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"  # the router's: a stop whose text held tool calls
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Request:
    """One generation request as the engine sees it."""

    prompt_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    rid: int = field(default_factory=new_request_id)
    output_ids: list[int] = field(default_factory=list)
    weight: float = 1.0  # the tenant's share weight (tenants file), for the workers' fair scheduling
    cache_salt: str | None = None  # with the tenant, scopes the prefix cache: only equal salts share pages
    public_tokens: int = 0  # the prompt starts with this many tokens of a prefix an admin published (router's say)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the ``top`` most likely tokens' (id, log-probability), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One step's news for one choice (``index``) of a request: new tokens and text, and maybe its end.

    ``choice_finish`` ends the choice; ``finish_reason`` ends the request (set on its last output, once every
    choice has ended). ``completion_tokens`` counts the tokens of every choice so far.
    """

    rid: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    error: KvfenceError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    pages: list[tuple[int, int]] | None = None  # on the last output: the (page, epoch) grants the request read
    verification: str | None = None  # on the last output: how its landed KV was verified
    queue_time: float | None = None  # on the first output: seconds the request waited in the router's queue
    preemptions: int = 0  # on the last output: times a worker preempted it (reported by the worker side)
    logprobs: list[TokenLogprob] | None = None  # one per token of ``token_ids`` when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first output, when asked: prompt tokens 2..n
    index: int = 0  # the choice these tokens belong to
    choice_finish: FinishReason | None = None  # set on the choice's last output
    cached_tokens: int = 0  # on the first output: prompt tokens read from the prefix cache, not computed

    def __post_init__(self) -> None:
        if self.choice_finish is None:
            self.choice_finish = self.finish_reason  # one choice: its end is the request's

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
