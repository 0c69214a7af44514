"""What the HTTP layer needs from an engine, local (colocated) or remote."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from kvfence.core import Request, RequestOutput


class EngineClient(Protocol):
    """An engine as the router's HTTP handlers see it.

    ``generate`` yields the request's outputs in order; the last one has
    ``finish_reason`` set. A request the engine rejects raises its
    ``KvfenceError`` from the iterator before any token. Cancelling the
    iterator (client gone) aborts the request.
    """

    @property
    def model_name(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    def generate(self, request: Request) -> AsyncIterator[RequestOutput]: ...

    def health(self) -> dict: ...
