"""Who waits, who goes next, who is refused: the per-tenant queue in front of the workers. Sans-IO.

A request that passed L1 admission joins its tenant's queue (``FairQueue.add``), or is refused at once with a
429 (``TooManyRequests``) when:

- its tenant already has ``max_queued`` requests waiting (``tenant_queue_full``);
- the server's queue is full (``server_queue_full``): once ``max_queued_requests`` wait, a tenant may add one only
  while it holds fewer than an equal share of them (``max_queued_requests`` / tenants waiting), so one tenant's
  flood cannot lock the others out; the queue never holds more than twice ``max_queued_requests``;
- its tenant's token bucket cannot pay for its prompt now (``tokens_per_minute``; ``Retry-After`` says when it
  can).

The dispatcher (``RouterCore``, or ``router/queued.py`` in colocated mode) takes the next request with ``next``
and ``start`` whenever a worker has room for it, tells ``charge`` about each completion token delivered and
``ended`` when a started request ends. Defaults: every tenant weight 1, no per-tenant quota.

Order, ``scheduling="fair"``: weighted fair queuing on tokens, by virtual token counters (start-time fair
queuing, as the VTC scheduler of Sheng et al., OSDI 2024). A tenant's counter grows by the tokens it is served
divided by its weight: a request's prompt tokens when it starts, its completion tokens as they are delivered
(so a tenant asking for long outputs pays for them as it gets them; ``max_tokens`` itself costs nothing). The
next request is the oldest one of the tenant with the smallest counter, among tenants under their
``max_concurrent_requests``. A tenant whose queue was empty restarts from at least the counter the latest start
began at: idling banks no credit, and a newcomer goes before every tenant already served.
``scheduling="fcfs"``: the oldest request first, whoever sent it (the baseline fair queuing is measured against).

Token bucket (``tokens_per_minute``): refilled continuously, holding at most one minute's worth; counts prompt
and completion tokens. A request's prompt tokens are taken when it joins the queue (and given back if it leaves
before it starts), its completion tokens as they are delivered, so the bucket can go below zero and the next
request then waits for it to refill. A request is admitted when the bucket holds its prompt tokens, or when the
bucket is full, so a prompt longer than a minute's budget is never refused for good.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from kvfence.core import Request, TooManyRequests

SCHEDULING = ("fair", "fcfs")


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's share and limits (``[tenants.NAME]`` in the tenants file); ``None``: no limit."""

    weight: float = 1.0
    max_concurrent_requests: int | None = None  # requests started on workers at once; the rest wait
    max_queued: int | None = None  # requests waiting at once; one more gets 429
    tokens_per_minute: int | None = None  # prompt + completion tokens; beyond, 429 with Retry-After


DEFAULT_QUOTA = TenantQuota()


@dataclass(frozen=True)
class QueuePolicy:
    """The quotas of every tenant (absent: ``DEFAULT_QUOTA``), the server's queue bound, and the order."""

    quotas: Mapping[str, TenantQuota] = field(default_factory=dict)
    max_queued_requests: int = 1024
    scheduling: str = "fair"

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling must be one of {SCHEDULING}, not {self.scheduling!r}")
        if self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be at least 1")

    def quota(self, tenant: str) -> TenantQuota:
        return self.quotas.get(tenant, DEFAULT_QUOTA)


@dataclass(frozen=True)
class Queued:
    """A request waiting for a worker; ``seq`` is its place in arrival order."""

    req: Request
    seq: int


@dataclass
class TokenBucket:
    """``per_minute`` tokens a minute, refilled continuously, holding at most one minute's worth."""

    per_minute: int
    level: float
    at: float  # when ``level`` was last brought up to date

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60)
        self.at = max(self.at, now)

    def wait(self, tokens: int, now: float) -> float:
        """Seconds until the bucket can pay ``tokens`` (0: now). A full bucket pays anything."""
        self.refill(now)
        need = min(tokens, self.per_minute)
        return 0.0 if self.level >= need else (need - self.level) * 60 / self.per_minute

    def take(self, tokens: float) -> None:
        self.level = min(self.per_minute, self.level - tokens)


class FairShares:
    """Weighted fair shares of tokens across tenants: one virtual token counter per tenant (start-time fair
    queuing). The router's queue and each worker's scheduler order their waiting work by it.

    A tenant's counter grows by the tokens it is served divided by its weight; the smallest counter goes next.
    ``resume`` a tenant whose work starts again after none was waiting or running: it restarts from at least
    the counter the latest start began at, so idling banks no credit.
    """

    def __init__(self) -> None:
        self.served: dict[str, float] = {}  # tenant -> tokens served / weight
        self.virtual_time = 0.0  # the counter the latest start began at

    def counter(self, tenant: str) -> float:
        return self.served.get(tenant, self.virtual_time)

    def resume(self, tenant: str) -> None:
        self.served[tenant] = max(self.served.get(tenant, 0.0), self.virtual_time)

    def start(self, tenant: str, tokens: int, weight: float) -> None:
        """Work of ``tenant`` starts: the virtual time moves to its counter, which then pays for ``tokens``."""
        self.virtual_time = max(self.virtual_time, self.counter(tenant))
        self.charge(tenant, tokens, weight)

    def charge(self, tenant: str, tokens: int, weight: float) -> None:
        self.served[tenant] = self.counter(tenant) + tokens / weight


class FairQueue:
    """The waiting requests of every tenant, their order, and the quotas checked at the door."""

    def __init__(self, policy: QueuePolicy | None = None) -> None:
        self.policy = policy or QueuePolicy()
        self.queues: dict[str, deque[Queued]] = {}  # tenants with requests waiting, each oldest first
        self.tenant_of: dict[int, str] = {}  # rid -> tenant, for every waiting request
        self.started: dict[str, int] = {}  # tenant -> requests started and not yet ended
        self.shares = FairShares()  # counters move only with scheduling="fair"
        self.buckets: dict[str, TokenBucket] = {}
        self.arrivals = 0

    def __len__(self) -> int:
        return len(self.tenant_of)

    def __contains__(self, rid: int) -> bool:
        return rid in self.tenant_of

    def waiting(self, tenant: str) -> int:
        return len(self.queues.get(tenant, ()))

    def lengths(self) -> dict[str, int]:
        """Requests waiting per tenant, for every tenant seen so far (0 for those with none)."""
        return {t: self.waiting(t) for t in sorted(self.shares.served)}

    def entries(self) -> Iterator[Queued]:
        for queue in list(self.queues.values()):
            yield from list(queue)

    # -- the door ---------------------------------------------------------------------------------------

    def add(self, req: Request, now: float) -> TooManyRequests | None:
        """Queue ``req``, or say why not (a 429 to deliver; nothing was queued)."""
        tenant = req.tenant
        err = self._refusal(req, now)
        if err is not None:
            return err
        self.arrivals += 1
        self._queue_of(tenant).append(Queued(req, self.arrivals))
        self.tenant_of[req.rid] = tenant
        bucket = self.buckets.get(tenant)
        if bucket is not None:
            bucket.take(req.prompt_len)
        return None

    def requeue(self, req: Request) -> None:
        """Put a started request back at the head of its tenant's queue (its worker died before it sent a token;
        call ``ended`` for it first). No quota is checked and its bucket is not charged again."""
        self._queue_of(req.tenant).appendleft(Queued(req, 0))
        self.tenant_of[req.rid] = req.tenant

    def _queue_of(self, tenant: str) -> deque[Queued]:
        if tenant not in self.queues:  # backlogged again: no credit for the time it was idle
            self.shares.resume(tenant)
            self.queues[tenant] = deque()
        return self.queues[tenant]

    def _refusal(self, req: Request, now: float) -> TooManyRequests | None:
        tenant, quota = req.tenant, self.policy.quota(req.tenant)
        if quota.max_queued is not None and self.waiting(tenant) >= quota.max_queued:
            return TooManyRequests(f"Too many requests of this API key are waiting ({quota.max_queued} at most); "
                                   "retry shortly.", reason="tenant_queue_full")
        if self._server_queue_full(tenant):
            return TooManyRequests("The server's request queue is full; retry shortly.", reason="server_queue_full")
        if quota.tokens_per_minute is None:
            return None
        bucket = self.buckets.setdefault(tenant, TokenBucket(quota.tokens_per_minute, quota.tokens_per_minute, now))
        wait = bucket.wait(req.prompt_len, now)
        if wait == 0:
            return None
        return TooManyRequests(
            f"Rate limit reached for tokens per minute: limit {quota.tokens_per_minute}, available "
            f"{max(0, math.floor(bucket.level))}, requested {req.prompt_len}. Please try again in {math.ceil(wait)}s.",
            retry_after=wait, reason="tokens_per_minute", kind="tokens")

    def _server_queue_full(self, tenant: str) -> bool:
        bound, total = self.policy.max_queued_requests, len(self)
        if total < bound:
            return False
        if total >= 2 * bound:
            return True
        tenants = len(self.queues) + (tenant not in self.queues)
        return self.waiting(tenant) >= bound / tenants

    # -- the way out ------------------------------------------------------------------------------------

    @property
    def fair(self) -> bool:
        """Weighted fair order; else first come, first served (and no counters are kept)."""
        return self.policy.scheduling == "fair"

    def next(self) -> Queued | None:
        """The request that goes next (left in the queue until ``start``), or ``None`` if none may."""
        fair = self.fair
        best, best_key = None, None
        for tenant, queue in self.queues.items():
            if not self._may_start(tenant):
                continue
            head = queue[0]
            key = (self.shares.counter(tenant), head.seq) if fair else (head.seq,)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def start(self, entry: Queued) -> None:
        """``entry`` leaves the queue for a worker: its tenant pays for its prompt. The request takes its tenant's
        weight along (``Request.weight``), for the workers' own fair scheduling."""
        tenant = self._remove(entry.req.rid)
        entry.req.weight = self.policy.quota(tenant).weight
        if self.fair:
            self.shares.start(tenant, entry.req.prompt_len, entry.req.weight)
        self.started[tenant] = self.started.get(tenant, 0) + 1

    def withdraw(self, rid: int) -> Request | None:
        """Take a waiting request out (its client left, or no worker can serve it); its tokens go back."""
        tenant = self.tenant_of.get(rid)
        if tenant is None:
            return None
        entry = next(e for e in self.queues[tenant] if e.req.rid == rid)
        self._remove(rid)
        bucket = self.buckets.get(tenant)
        if bucket is not None:
            bucket.take(-entry.req.prompt_len)
        return entry.req

    def charge(self, tenant: str, completion_tokens: int) -> None:
        """``completion_tokens`` of a started request of ``tenant`` were delivered."""
        if self.fair:
            self.shares.charge(tenant, completion_tokens, self.policy.quota(tenant).weight)
        bucket = self.buckets.get(tenant)
        if bucket is not None:
            bucket.take(completion_tokens)

    def ended(self, tenant: str) -> None:
        """A started request of ``tenant`` ended, however."""
        self.started[tenant] -= 1
        if not self.started[tenant]:
            del self.started[tenant]

    def _may_start(self, tenant: str) -> bool:
        cap = self.policy.quota(tenant).max_concurrent_requests
        return cap is None or self.started.get(tenant, 0) < cap

    def _remove(self, rid: int) -> str:
        tenant = self.tenant_of.pop(rid)
        queue = self.queues[tenant]
        if queue[0].req.rid == rid:
            queue.popleft()
        else:
            queue.remove(next(e for e in queue if e.req.rid == rid))
        if not queue:
            del self.queues[tenant]
        return tenant


@dataclass(frozen=True)
class DispatchLimits:
    """When a worker has room for one more request. A worker holding none of the router's requests always has.

    - ``prefill_backlog_tokens``: a prefill worker takes a prompt only while the prompt tokens it holds and has
      not handed off yet (no first token) are fewer than this, so whatever is sent next waits behind less than
      this much prefill work (two 512-token steps by default). ``None``: no bound.
    - ``output_reserve_tokens``: a decode worker takes a request only while its KV pages (less quarantined ones)
      cover every request sent to it, each counted for its prompt plus up to this many of its ``max_tokens``
      (what it will likely generate; past that, the decode worker's own preemption takes over). ``None``: pages
      are not checked.
    - ``worker_grace``: seconds a role may have no live worker (restarting) before the requests waiting for it
      get 503.
    """

    prefill_backlog_tokens: int | None = 1024
    output_reserve_tokens: int | None = 512
    worker_grace: float = 30.0


UNGATED = DispatchLimits(prefill_backlog_tokens=None, output_reserve_tokens=None)
