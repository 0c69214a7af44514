"""Every control message between router, prefill and decode, and their one codec.

Messages are tagged msgspec structs encoded as JSON (request ids are 128-bit,
beyond msgpack's integers). ``decode_message`` rejects anything unknown,
truncated or malformed with ``BadMessage``; a worker logs and drops it.

Flow (decode first, as in docs/protocol.md):

    router  --Admit-->    decode   --Dest-->   prefill
    router  --Prefill-->  prefill  ==KV pages + tags==> decode pool
                          prefill  --Progress...--> decode            (per computed chunk)
                          prefill  --Done/Fail--> decode
    decode  --Output...-> router                      (tokens, then the end)
    any leg --Reject-->   router                      (and Fail/Cancel to its peer)
    router  --Cancel-->   decode   --Abort--> prefill --AbortAck--> decode

Membership: every envelope carries its sender's epoch. The router moves a
worker's epoch on when it declares the worker dead, drops whatever arrives
under an older one and answers it with Fenced (docs/protocol.md, "Fencing").
"""

from __future__ import annotations

import hashlib
from dataclasses import fields
from typing import ClassVar, Union

import msgspec

from kvfence.core import KvfenceError, SamplingParams, TokenLogprob
from kvfence.descriptors import Descriptor


class ErrorInfo(msgspec.Struct, frozen=True):
    """A KvfenceError on the wire: status and OpenAI error fields."""

    status: int
    type: str
    message: str
    code: str | None = None
    param: str | None = None
    layer: str | None = None

    @classmethod
    def of(cls, err: KvfenceError) -> ErrorInfo:
        return cls(err.status, err.type, err.message, err.code, err.param, err.layer)

    def to_error(self) -> KvfenceError:
        err = KvfenceError(self.message, param=self.param, code=self.code)
        err.status, err.type, err.layer = self.status, self.type, self.layer
        return err


class Params(msgspec.Struct, frozen=True):
    """``core.SamplingParams`` on the wire, field for field."""

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
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None
    n: int = 1

    @classmethod
    def of(cls, p: SamplingParams) -> Params:
        return cls(**{f.name: getattr(p, f.name) for f in fields(p)})

    def to_sampling(self) -> SamplingParams:
        return SamplingParams(**msgspec.structs.asdict(self))


class Msg(msgspec.Struct, frozen=True, tag=True):
    """Base of every control message."""


class RequestMsg(Msg, frozen=True):
    """A message about one request."""

    rid: int


# -- router -> workers --------------------------------------------------------


class Admit(RequestMsg, frozen=True):
    """Router -> decode: grant pages for this prompt and tell ``prefill`` where to write."""

    tenant: str
    prompt_ids: list[int]
    params: Params
    prefill: str  # the prefill worker's id
    weight: float = 1.0  # the tenant's share weight: decode grants pages and batch slots in weighted fair order


class Prefill(RequestMsg, frozen=True):
    """Router -> prefill: compute this prompt's KV into the pages ``decode`` will name in a Dest."""

    tenant: str
    prompt_ids: list[int]
    params: Params
    decode: str  # the decode worker's id
    weight: float = 1.0  # the tenant's share weight: prefill computes prompts in weighted fair order
    cache_salt: str | None = None  # with ``tenant``, the scope of prefill's prefix cache
    public_tokens: int = 0  # the prompt starts with this many tokens of an admin-published prefix (public pages)


class Cancel(RequestMsg, frozen=True):
    """Router -> worker: the client is gone; end the request (safely)."""


# -- decode <-> prefill -----------------------------------------------------------


class Dest(RequestMsg, frozen=True):
    """Decode -> prefill: write exactly ``expected_tokens`` tokens of KV into these (page, epoch) grants."""

    pages: list[tuple[int, int]]
    expected_tokens: int


class Done(RequestMsg, frozen=True):
    """Prefill -> decode: every write has landed; no further write follows.

    With ``n`` > 1 choices, ``more_tokens`` are the first tokens of choices 1..n-1, sampled from the same logits
    as ``first_token`` (choice 0's), each with its choice's own generator; decode forks the choices."""

    tokens: int
    checksum: int
    first_token: int
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # when the request asked for them (echo)
    more_tokens: list[int] = []
    more_logprobs: list[TokenLogprob | None] = []  # one per more_tokens, when the request asked for logprobs
    cached_tokens: int = 0  # prompt tokens prefill read from its prefix cache (all were written, cached or not)

    def firsts(self) -> list[tuple[int, TokenLogprob | None]]:
        """Each choice's first token and its logprob."""
        more = self.more_logprobs or [None] * len(self.more_tokens)
        return [(self.first_token, self.first_logprob), *zip(self.more_tokens, more, strict=True)]


class Progress(RequestMsg, frozen=True):
    """Prefill -> decode: ``tokens`` of the prompt are computed so far; the handoff is alive (its timeout restarts)."""

    tokens: int


class Fail(RequestMsg, frozen=True):
    """Either leg -> its peer: this request failed; from prefill it promises no write follows."""

    error: ErrorInfo


class Abort(RequestMsg, frozen=True):
    """Decode -> prefill: stop; answer AbortAck once no write of yours can still land."""


class AbortAck(RequestMsg, frozen=True):
    """Prefill -> decode: no write for this request is in flight or will be issued."""


# -- workers -> router --------------------------------------------------------------


class Output(RequestMsg, frozen=True):
    """Decode -> router: new tokens and text; ``finish_reason`` set on the last, with its audit facts."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    pages: list[tuple[int, int]] | None = None  # last only: (page, epoch) grants read
    verification: str | None = None  # last only: how the landed KV was verified
    preemptions: int = 0  # last only: times decode preempted this request (the router counts them per tenant)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # first only, when asked: prompt tokens 2..n
    index: int = 0  # the choice these tokens belong to (``n`` > 1)
    choice_finish: str | None = None  # that choice ended (``finish_reason`` ends the request, after every choice)
    cached_tokens: int = 0  # first only: prompt tokens read from prefill's prefix cache


class Reject(RequestMsg, frozen=True):
    """Worker -> router: this request failed here; the client gets ``error``."""

    error: ErrorInfo
    worker: str = ""


# -- liveness and load ------------------------------------------------------------


class PrefillSide(msgspec.Struct, frozen=True, tag_field="role", tag="prefill"):
    """What only a prefill worker's Hello says: the digest of the Peers it holds (``Peers.digest``)."""

    role: ClassVar[str] = "prefill"
    peers: str


class DecodeSide(msgspec.Struct, frozen=True, tag_field="role", tag="decode"):
    """What only a decode worker's Hello says: where prefill writes its KV. The router hands it on in ``Peers``."""

    role: ClassVar[str] = "decode"
    target: Descriptor  # its KV pool's data-plane target
    kv_pages: int  # pages in that pool: prefill needs the count to place the tags


class Hello(Msg, frozen=True):
    """Worker -> router, at start and every heartbeat: who I am, where I listen, how loaded I am."""

    worker: str
    control: str  # ZeroMQ address this worker's inbox is bound to
    side: PrefillSide | DecodeSide  # its role's own part; the tag names the role
    pool_tokens: int
    max_context: int
    free_pages: int = 0
    queued_tokens: int = 0
    running: int = 0
    pid: int = 0
    quarantined_pages: int = 0
    total_pages: int = 0
    quarantine_reasons: dict[str, int] = {}  # reason -> pages quarantined for it
    cpu: str = ""  # the model's compute capabilities here (``kernels.Capabilities.summary``); "" on a GPU
    backend: str = ""  # the model's backend here (``Backend.name``: "c-amx", "torch", ...)
    prompt_tokens_computed: int = 0  # prompt positions whose K/V this worker computed since it started
    cached_pages: int = 0  # pages its prefix cache holds (those no request reads count in free_pages too)
    cache_evictions: int = 0  # pages its prefix cache evicted since it started
    safety_off: list[str] = []  # the safety layers this worker runs with switched off (``KVFENCE_UNSAFE``)

    @property
    def role(self) -> str:
        """The worker's role, "prefill" or "decode": ``side``'s tag."""
        return self.side.role


class Peers(Msg, frozen=True):
    """Router -> prefill: the live decode workers and their data-plane targets (sent before any use)."""

    decodes: dict[str, DecodeSide]

    def digest(self) -> str:
        """A short fingerprint; a prefill's Hello carries the one it holds, so the router can resend a lost Peers."""
        return hashlib.blake2b(msgspec.json.encode(self.decodes, order="sorted"), digest_size=8).hexdigest()


class WorkerDown(Msg, frozen=True):
    """Router -> workers: ``worker`` is dead; none of its writes or messages will come.

    ``fenced``: it was declared dead for its silence and may still be running: a decode worker keeps the pages it
    granted to it quarantined until it answers for them (L6), instead of freeing them at once."""

    worker: str
    fenced: bool = False


class Fenced(Msg, frozen=True):
    """Router -> a worker that spoke under an epoch the router has moved past: you were declared dead. Drop every
    request you hold (their clients have their errors), release their pages under L6, and say Hello again under
    ``epoch``."""

    epoch: int


Message = Union[Admit, Prefill, Cancel, Dest, Done, Progress, Fail, Abort, AbortAck, Output, Reject, Hello,  # noqa: UP007
                Peers, WorkerDown, Fenced]


class Envelope(msgspec.Struct, frozen=True):
    """What travels: the sender's id, one message, and the sender's membership epoch (``Fenced``)."""

    sender: str
    msg: Message
    epoch: int = 0


class BadMessage(ValueError):
    """Bytes that are not a valid Envelope."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Envelope)


def encode_message(sender: str, msg: Message, epoch: int = 0) -> bytes:
    return _encoder.encode(Envelope(sender, msg, epoch))


def decode_message(data: bytes) -> Envelope:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadMessage(str(exc)) from exc
