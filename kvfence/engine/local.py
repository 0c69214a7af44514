"""An ``EngineClient`` that runs an ``Engine`` on its own thread in this process.

The engine thread owns the engine; the event loop only puts commands in an
inbox and receives each step's outputs in one batch through
``call_soon_threadsafe``. When idle, the thread runs the integrity check once.
The pool's figures that ``health`` reports are taken on the engine thread after
each step (the prefix cache may only be read there).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvfence.core import KvfenceError, Request, RequestOutput, ServiceUnavailable
from kvfence.engine.engine import Engine
from kvfence.model import kernels

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    req: Request
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Abort:
    rid: int


class LocalEngine:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_context = engine.config.max_context
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stopping = False
        self._publish()
        self._thread = threading.Thread(target=self._run, name="kvfence-engine", daemon=True)
        kernels.release_thread_pool()  # the engine thread's parallel regions would otherwise wait on wake-ups
        self._thread.start()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        if not self._thread.is_alive():
            raise ServiceUnavailable("The engine is not running.")
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(_Add(request, sink, asyncio.get_running_loop()))
        finished = False
        try:
            while not finished:
                out: RequestOutput = await sink.get()
                if out.error is not None:
                    raise out.error
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._inbox.put(_Abort(request.rid))

    def health(self) -> dict:
        e = self.engine
        return {
            "status": "ok" if self._thread.is_alive() else "engine thread stopped",
            "mode": "colocated",
            "max_context": e.config.max_context,
            "kv_pool_tokens": e.pages.num_pages * e.config.page_size,
            "running": len(e.scheduler.running),
            "waiting": len(e.scheduler.waiting),
            "kv_pages_total": e.pages.num_pages,
            **self._pool,
            "preemptions": e.scheduler.num_preempted,
            "prompt_tokens_computed": e.prompt_tokens_computed,
            **({"cpu": kernels.detect().summary()} if e.model.device.type == "cpu" else {}),
            "backend": e.model.backend.name,
        }

    def close(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # -- engine thread -------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox(block=not self.engine.has_work)
                if self.engine.has_work:
                    self._deliver(self.engine.step())
                self._publish()
        except Exception:
            log.exception("engine thread crashed")
            self._fail_all(ServiceUnavailable("The engine stopped unexpectedly."))

    def _publish(self) -> None:
        """Free pages (cached ones no request reads count too), cached pages and evictions, for ``health``."""
        e, cache = self.engine, self.engine.cache
        self._pool = {"kv_pages_free": e.free_pages, "cached_pages": len(cache.entries) if cache else 0,
                      "cache_evictions": cache.evictions if cache else 0}

    def _drain_inbox(self, block: bool) -> None:
        if block:
            try:
                self._handle(self._inbox.get(timeout=1.0))
            except queue.Empty:
                self.engine.check_integrity()  # idle: nothing may be held
                return
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(self, cmd: _Add | _Abort | None) -> None:
        if isinstance(cmd, _Add):
            self._sinks[cmd.req.rid] = (cmd.sink, cmd.loop)
            try:
                self.engine.add(cmd.req)
            except KvfenceError as err:
                self._deliver([RequestOutput(cmd.req.rid, [], "", error=err)])
        elif isinstance(cmd, _Abort):
            self.engine.abort(cmd.rid)
            self._sinks.pop(cmd.rid, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._sinks.get(out.rid)
            if entry is None:
                continue
            sink, loop = entry
            if out.finished or out.error is not None:
                del self._sinks[out.rid]
            by_loop.setdefault(loop, []).append((sink, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the receiving loop has closed: nobody is listening
                pass

    def _fail_all(self, err: KvfenceError) -> None:
        self._deliver([RequestOutput(rid, [], "", error=err) for rid in list(self._sinks)])


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for sink, out in items:
        sink.put_nowait(out)
