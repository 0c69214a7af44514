"""Colocated mode's front: the router's per-tenant queue, quotas and fair order in front of one in-process engine.

``QueuedEngine`` wraps an ``EngineClient`` (``LocalEngine``) with the ``FairQueue`` that ``RouterCore`` uses in
disaggregated mode, so a tenants file's quotas, ``--max-queued-requests`` and ``--scheduling`` mean the same in
both modes. It runs on the event loop only (no locks).

Contracts:

- A request the queue refuses raises its 429 before any output; a queued one starts in the queue's order, only
  while the engine has room for it (``DispatchLimits``, the one engine counting as both the prefill and the decode
  worker): the prompt tokens started and not yet answered by a first token are fewer than
  ``prefill_backlog_tokens``, and the KV pages reserved for the started requests (prompt plus up to
  ``output_reserve_tokens`` each) fit the pool. An engine with nothing started always takes the next request.
- A client that leaves while queued is removed from the queue; one that leaves later aborts as before.
- A started request's prompt leaves the backlog with its first output, and the queue is dispatched again then;
  whatever way it ends, its pages' room is given back and the queue is dispatched again.
- Its first output carries ``queue_time``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from kvfence.core import Request, RequestOutput
from kvfence.engine.client import EngineClient
from kvfence.protocol.capacity import DispatchLimits, FairQueue, QueuePolicy


class QueuedEngine:
    def __init__(self, engine: EngineClient, policy: QueuePolicy | None = None, limits: DispatchLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.queue = FairQueue(policy)
        self.limits = limits or DispatchLimits()
        self.clock = clock
        self._go: dict[int, asyncio.Future] = {}  # rid -> resolved when the request may start
        self._started = 0
        self._backlog_tokens = 0  # prompts started without a first token yet
        self._reserved_pages = 0
        health = engine.health()
        pages, tokens = health.get("kv_pages_total"), health.get("kv_pool_tokens")
        self._pool_pages: int | None = pages if pages and tokens else None  # None: pages are not checked
        self._page_tokens = tokens // pages if pages and tokens else 1

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def health(self) -> dict:
        return {**self.engine.health(), "queued": len(self.queue), "queued_by_tenant": self.queue.lengths()}

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for ``request`` once it leaves the queue; its 429 if the queue refuses it."""
        submitted = self.clock()
        err = self.queue.add(request, submitted)
        if err is not None:
            raise err
        go = self._go[request.rid] = asyncio.get_running_loop().create_future()
        self._dispatch()
        reserved = self._pages(request)
        try:
            await go
        except asyncio.CancelledError:  # the client left while it waited
            self._go.pop(request.rid, None)
            if self.queue.withdraw(request.rid) is None:  # it had just been started
                self._release(request, reserved, handed_off=False)
            raise
        queue_time = self.clock() - submitted
        handed_off = False
        try:
            async for out in self.engine.generate(request):
                if not handed_off:
                    out.queue_time, handed_off = queue_time, True
                    self._backlog_tokens -= request.prompt_len
                    self._dispatch()  # its prompt is computed: the prefill backlog has room for the next
                self.queue.charge(request.tenant, len(out.token_ids))
                yield out
        finally:
            self._release(request, reserved, handed_off)

    def _dispatch(self) -> None:
        while (entry := self.queue.next()) is not None and self._has_room(entry.req):
            self.queue.start(entry)
            self._started += 1
            self._backlog_tokens += entry.req.prompt_len
            self._reserved_pages += self._pages(entry.req)
            self._go.pop(entry.req.rid).set_result(None)

    def _release(self, request: Request, reserved: int, handed_off: bool) -> None:
        self._started -= 1
        self._reserved_pages -= reserved
        if not handed_off:
            self._backlog_tokens -= request.prompt_len
        self.queue.ended(request.tenant)
        self._dispatch()

    def _has_room(self, req: Request) -> bool:
        if not self._started:
            return True
        bound = self.limits.prefill_backlog_tokens
        if bound is not None and self._backlog_tokens >= bound:
            return False
        return self._pool_pages is None or self._reserved_pages + self._pages(req) <= self._pool_pages

    def _pages(self, req: Request) -> int:
        """The prompt and output reserve; each further choice adds a copy of the last page and its own reserve."""
        reserve = self.limits.output_reserve_tokens
        if reserve is None or self._pool_pages is None:
            return 0
        reserve = min(req.params.max_tokens, reserve)
        pages = -(-(req.prompt_len + reserve) // self._page_tokens)
        return pages + (req.params.n - 1) * (1 + -(-reserve // self._page_tokens))
