"""What protocol cores ask their IO loops to do. Cores never act themselves."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.core import KvfenceError
from kvfence.kvcache.pages import PageGrant
from kvfence.protocol.messages import Admit, Done, Message, Output, Prefill


@dataclass(frozen=True)
class Send:
    """Send ``msg`` to the process with id ``to``."""

    to: str
    msg: Message


@dataclass(frozen=True)
class StartDecode:
    """Decode: the prompt's KV landed and verified; the engine takes over these pages and decodes."""

    admit: Admit
    grants: list[PageGrant]
    done: Done  # prefill's report: the first token (and the logprobs asked for) come with it


@dataclass(frozen=True)
class StopDecode:
    """Decode: drop the request from the engine, which frees its pages."""

    rid: int


@dataclass(frozen=True)
class StartPrefill:
    """Prefill: compute ``prompt_ids`` (the prompt of ``msg``, the router's request) and write its KV and tags into
    ``dest`` pages of ``decode``."""

    rid: int
    prompt_ids: list[int]
    dest: list[tuple[int, int]]
    decode: str
    msg: Prefill | None = field(default=None, compare=False)  # sampling parameters, tenant, cache scope


@dataclass(frozen=True)
class StopPrefill:
    """Prefill: stop computing early; report back once no write can still land."""

    rid: int


@dataclass(frozen=True)
class Deliver:
    """Router: hand an output (or the request's error) to its client."""

    rid: int
    output: Output | None = None
    error: KvfenceError | None = None


Action = Send | StartDecode | StopDecode | StartPrefill | StopPrefill | Deliver
