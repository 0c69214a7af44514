"""The router's engine: an ``EngineClient`` that drives ``RouterCore`` over ZeroMQ on the event loop.

The core's actions are carried out by a ``RouterExecutor`` (``protocol/executor.py``) against this
class: ``send`` puts a message on the channel, ``deliver`` hands an output to its client's stream.

Everything runs on the asyncio loop of the HTTP server, so the core needs no
locks: HTTP handlers call ``generate``; one task receives worker messages;
one task watches heartbeats: a worker silent for ``SUSPECT_S`` is suspected
(no new request goes to it), one silent for ``worker_timeout`` is declared
dead and fenced (``RouterCore.worker_down``).

Admin controls: ``worker_table`` and ``set_drained`` (drained workers get no
new request); ``route(rid)`` names the (prefill, decode) pair a recent
request was sent to, for the audit log.

A request waits in the core's per-tenant queue until a pair has room for it;
its first output carries how long it waited (``RequestOutput.queue_time``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from kvfence.channel import Channel
from kvfence.core import FinishReason, Request, RequestOutput
from kvfence.faults import Faults
from kvfence.protocol.actions import Deliver
from kvfence.protocol.executor import RouterExecutor
from kvfence.protocol.messages import Admit, Envelope, Hello, Message
from kvfence.protocol.router import RouterCore, WorkerInfo
from kvfence.router.admin import RecentRoutes, Route
from kvfence.router.settings import RouterSettings

log = logging.getLogger(__name__)

SUSPECT_S = 2.0  # four heartbeats missed; local deaths are seen sooner: the supervisor watches exit codes
POLL_S = 0.01  # while requests run the inbox is also polled this often, should a wake-up be missed
IDLE_POLL_S = 0.25  # and this often while none runs (heartbeats only): an idle router stays off the CPU


class RemoteEngine:
    def __init__(self, settings: RouterSettings) -> None:
        s = self.settings = settings
        self.channel = Channel(s.bind, s.advertise, Faults.from_env(), s.cluster_key)
        self.me = self.channel.me
        self.model_name, self.max_context = s.model_name, s.max_context
        self.core = RouterCore(self.me, s.max_context, s.safety, s.timeouts.silence, s.policy, s.limits)
        self.executor = RouterExecutor(self.core, self, self, time.monotonic)
        self._sinks: dict[int, asyncio.Queue] = {}
        self._dispatched: dict[int, float] = {}  # rid -> when it left the queue, until its first output
        self.assigned: dict[str, int] = {}  # requests sent to each worker since start
        self._routes = RecentRoutes()
        self._last_seen: dict[str, float] = {}
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()  # the inbox may have news, or the first request in flight wants the short poll

    # -- EngineClient ------------------------------------------------------------

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        self._ensure_started()
        sink: asyncio.Queue = asyncio.Queue()
        self._sinks[request.rid] = sink
        if len(self._sinks) == 1:
            self._wake.set()  # the receive loop may sleep on the idle poll: back to the short one
        finished = False
        submitted = time.monotonic()
        try:
            self.executor.run(self.core.submit(request, submitted))
            while not finished:
                out: RequestOutput = await sink.get()
                if out.error is not None:
                    finished = True
                    raise out.error
                dispatched = self._dispatched.pop(request.rid, None)
                if dispatched is not None:
                    out.queue_time = dispatched - submitted
                finished = out.finished
                yield out
        finally:
            self._sinks.pop(request.rid, None)
            self._dispatched.pop(request.rid, None)
            if not finished:
                self.executor.run(self.core.client_gone(request.rid))

    def health(self) -> dict:
        """Status, in-flight figures (``transfers_in_flight``: requests in their handoff) and each worker's."""
        workers = {w: self._worker_health(i) for w, i in self.core.workers.items()}
        ready = sum(1 for i in self.core.workers.values() if i.hello.role == "decode") and \
            sum(1 for i in self.core.workers.values() if i.hello.role == "prefill")
        return {"status": "ok" if ready else "waiting for workers", "mode": "disaggregated",
                "max_context": self.max_context, "in_flight": self.core.in_flight(), "queued": self.core.queued(),
                "queued_by_tenant": self.core.queue.lengths(),
                "transfers_in_flight": self.core.in_handoff(), "stale_messages": self.core.stale_messages,
                "workers": workers}

    def _worker_health(self, info: WorkerInfo) -> dict:
        h = info.hello
        return {"role": h.role, "pid": h.pid, "in_flight": info.in_flight, "assigned": self.assigned.get(h.worker, 0),
                "backlog_tokens": info.backlog_tokens, "reserved_pages": info.reserved_pages,
                "free_pages": h.free_pages, "total_pages": h.total_pages, "quarantined_pages": h.quarantined_pages,
                "quarantine_reasons": h.quarantine_reasons,
                "running": h.running, "pool_tokens": h.pool_tokens, "max_context": h.max_context,
                "drained": h.worker in self.core.drained, "suspected": h.worker in self.core.suspected,
                "epoch": self.core.epochs.get(h.worker, 0), "cpu": h.cpu, "backend": h.backend,
                "prompt_tokens_computed": h.prompt_tokens_computed, "cached_pages": h.cached_pages,
                "cache_evictions": h.cache_evictions, "safety_layers_off": h.safety_off}

    # -- admin ----------------------------------------------------------------------

    def worker_table(self) -> list[dict]:
        """Live workers and drained ones that are gone (``live`` false), ordered by id."""
        ids = sorted(set(self.core.workers) | self.core.drained)
        return [self._table_entry(w) for w in ids]

    def _table_entry(self, worker: str) -> dict:
        info = self.core.workers.get(worker)
        if info is None:
            return {"id": worker, "role": None, "drained": True, "live": False}
        return {"id": worker, "live": True, **self._worker_health(info)}

    def set_drained(self, worker: str, drained: bool) -> None:
        """Take ``worker`` out of rotation (kept across its restarts) or put it back; ``KeyError`` if unknown."""
        if worker not in self.core.workers and worker not in self.core.drained:
            raise KeyError(worker)
        self.executor.run(self.core.set_drained(worker, drained))

    def route(self, rid: int) -> Route | None:
        """The pair a recent request was sent to last, with the decode worker's epoch; ``None`` if never sent."""
        return self._routes.get(rid)

    def _note_route(self, admit: Admit, decode: str) -> None:
        """Count a request just sent against both workers of its pair, and remember the pair and when."""
        for worker in (admit.prefill, decode):
            self.assigned[worker] = self.assigned.get(worker, 0) + 1
        rid = self.core.client_of(admit.rid)  # a retry travels under another id
        self._routes.add(rid, Route(admit.prefill, decode, self.core.epochs.get(decode, 0)))
        if rid in self._sinks:
            self._dispatched.setdefault(rid, time.monotonic())

    # -- plumbing -----------------------------------------------------------------

    def start(self) -> None:
        """Start the receive and liveness tasks on the running loop."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive()), loop.create_task(self._watch())]

    def _ensure_started(self) -> None:
        if not self._tasks:
            self.start()

    async def wait_for_workers(self, timeout: float) -> bool:
        """Wait until ``expected_workers`` have said Hello."""
        self._ensure_started()
        deadline = time.monotonic() + timeout
        while len(self.core.workers) < self.settings.expected_workers:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def worker_died(self, worker: str, fenced: bool = False) -> None:
        """Called by a supervisor that saw the process exit, or (``fenced``) by the watch when a worker has been
        silent for ``worker_timeout``: end or retry its requests now."""
        self._last_seen.pop(worker, None)
        self.channel.forget(worker)
        self.executor.run(self.core.worker_down(worker, fenced))

    async def _receive(self) -> None:
        """Handle worker messages as they come: the inbox's file descriptor wakes the loop (ZeroMQ signals it
        edge-style, so every wake-up drains the inbox), with a poll as a safety net: every POLL_S while requests
        run, every IDLE_POLL_S while none does (``generate`` wakes the loop when the first one starts)."""
        wake, loop = self._wake, asyncio.get_running_loop()
        loop.add_reader(self.channel.fd, wake.set)
        try:
            while True:
                wake.clear()
                envelopes = self.channel.receive(0)
                if envelopes:
                    self._handle(envelopes)
                    continue
                try:  # asyncio.timeout: no task per wait, unlike wait_for on 3.11
                    async with asyncio.timeout(POLL_S if self._sinks else IDLE_POLL_S):
                        await wake.wait()
                except TimeoutError:
                    pass
        finally:
            loop.remove_reader(self.channel.fd)

    def _handle(self, envelopes: list[Envelope]) -> None:
        now = time.monotonic()
        for env in envelopes:
            msg = env.msg
            joins = isinstance(msg, Hello) and msg.worker not in self.core.workers
            self.executor.receive(env.sender, msg, env.epoch)
            if isinstance(msg, Hello) and msg.worker in self.core.workers:  # not a fenced one's
                if joins:
                    log.info("%s worker %s joined", msg.role, msg.worker)
                if msg.worker in self.core.suspected:
                    log.warning("worker %s speaks again after %.1fs", msg.worker, now - self._last_seen[msg.worker])
                    self.executor.run(self.core.set_suspected(msg.worker, False))
                self._last_seen[msg.worker] = now

    async def _watch(self) -> None:
        """Suspect quiet workers, declare silent ones dead, and end requests that heard nothing for too long."""
        while True:
            await asyncio.sleep(0.5)
            self._handle(self.channel.receive(0))  # judge silence on what has arrived, not on what is still unread
            now = time.monotonic()
            self.executor.tick()
            for worker, seen in list(self._last_seen.items()):
                if now - seen > self.settings.worker_timeout:
                    log.error("worker %s silent for %.1fs: declaring it dead and fencing it", worker, now - seen)
                    self.worker_died(worker, fenced=True)
                elif now - seen > SUSPECT_S and worker not in self.core.suspected:
                    log.warning("worker %s silent for %.1fs: suspected, no new request goes to it", worker,
                                now - seen)
                    self.executor.run(self.core.set_suspected(worker, True))

    # -- what the executor acts on ------------------------------------------------------

    def send(self, to: str, msg: Message) -> None:
        if isinstance(msg, Admit):
            self._note_route(msg, to)
        self.channel.send(to, msg)

    def deliver(self, d: Deliver) -> None:
        sink = self._sinks.get(d.rid)
        if sink is not None:
            sink.put_nowait(_to_output(d))


def _to_output(action: Deliver) -> RequestOutput:
    if action.error is not None:
        return RequestOutput(action.rid, [], "", FinishReason.ERROR, error=action.error)
    o = action.output
    assert o is not None  # a Deliver carries an error or an output
    finish = FinishReason(o.finish_reason) if o.finish_reason else None
    return RequestOutput(action.rid, o.token_ids, o.text, finish, prompt_tokens=o.prompt_tokens,
                         completion_tokens=o.completion_tokens, pages=o.pages, verification=o.verification,
                         preemptions=o.preemptions, logprobs=o.logprobs, prompt_logprobs=o.prompt_logprobs,
                         index=o.index, choice_finish=FinishReason(o.choice_finish) if o.choice_finish else finish,
                         cached_tokens=o.cached_tokens)

