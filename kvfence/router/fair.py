"""Blocking request preparation (JSON parsing, templating, tokenizing) off the event loop, fair across tenants.

Contracts:

- Jobs run on ``threads`` worker threads, never on the event loop. A tenant has at most one job running at a
  time, so with ``threads >= 2`` one tenant's burst never holds more than one thread: another tenant's job
  starts at once, or (when other tenants hold every thread too) after one job.
- Waiting jobs are served round-robin across tenants, first come first served within a tenant.
- A tenant's pending work (waiting and running) is bounded by cost, a job's cost being its body's bytes (at
  least ``MIN_JOB_COST``): a job that would take the tenant past ``max_pending_cost`` is refused at once with
  429. A tenant with nothing pending is always admitted, so one request of any allowed size fits.
- The bookkeeping runs on the event loop only; a worker thread only runs the job and hands back its result.
- A caller cancelled while its job waits withdraws the job; a running job finishes and its result is dropped.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvfence.core import TooManyRequests

T = TypeVar("T")
MIN_JOB_COST = 16 * 1024  # bytes: what a job counts at least, so many tiny jobs are bounded too
THREADS = 2


@dataclass(eq=False)
class _Job:
    fn: Callable[[], Any]
    cost: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    started: bool = False


class FairPool:
    """Runs blocking jobs for tenants on a few threads, round-robin across tenants (see the module docstring)."""

    def __init__(self, max_pending_cost: int, threads: int = THREADS) -> None:
        self.max_pending_cost = max_pending_cost
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvfence-prepare")
        self._idle_threads = threads
        self._waiting: dict[str, deque[_Job]] = {}  # tenants with waiting jobs, in round-robin order
        self._running: Counter[str] = Counter()
        self._pending_cost: Counter[str] = Counter()

    async def run(self, tenant: str, cost: int, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker thread in ``tenant``'s turn; its result or its exception.

        Raises ``TooManyRequests`` at once when ``tenant`` already has too much pending.
        """
        cost = max(cost, MIN_JOB_COST)
        pending = self._pending_cost[tenant]
        if pending and pending + cost > self.max_pending_cost:
            raise TooManyRequests("Too many requests of this API key are waiting to be tokenized; retry shortly.",
                                  reason="tokenization_backlog")
        job = _Job(fn, cost)
        self._pending_cost[tenant] += cost
        self._waiting.setdefault(tenant, deque()).append(job)
        self._dispatch()
        try:
            return await job.future
        except asyncio.CancelledError:
            self._withdraw(tenant, job)
            raise

    def pending(self, tenant: str) -> int:
        """``tenant``'s jobs waiting or running."""
        return len(self._waiting.get(tenant, ())) + self._running[tenant]

    def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._idle_threads:
            tenant = next((t for t in self._waiting if not self._running[t]), None)
            if tenant is None:
                return
            queue = self._waiting.pop(tenant)
            job = queue.popleft()
            if queue:
                self._waiting[tenant] = queue  # back of the ring
            job.started = True
            self._idle_threads -= 1
            self._running[tenant] += 1
            done = self._executor.submit(job.fn)

            def finished(f: Future[Any], t: str = tenant, j: _Job = job) -> None:
                loop.call_soon_threadsafe(self._finished, t, j, f)

            done.add_done_callback(finished)

    def _finished(self, tenant: str, job: _Job, done: Future) -> None:
        self._idle_threads += 1
        self._running[tenant] -= 1
        if tenant in self._waiting:  # its turn was this job: to the back of the ring
            self._waiting[tenant] = self._waiting.pop(tenant)
        self._release(tenant, job)
        if not job.future.done():
            error = done.exception()
            if error is None:
                job.future.set_result(done.result())
            else:
                job.future.set_exception(error)
        self._dispatch()

    def _withdraw(self, tenant: str, job: _Job) -> None:
        queue = self._waiting.get(tenant)
        if job.started or queue is None:
            return
        queue.remove(job)
        if not queue:
            del self._waiting[tenant]
        self._release(tenant, job)

    def _release(self, tenant: str, job: _Job) -> None:
        self._pending_cost[tenant] -= job.cost
        for counter in (self._pending_cost, self._running):
            if not counter[tenant]:
                del counter[tenant]
