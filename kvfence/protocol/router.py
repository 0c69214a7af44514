"""Router's protocol core: admission, the per-tenant queue, pairing, and turning worker messages into client results.

Sans-IO: ``submit``, ``client_gone``, ``handle``, ``worker_up``,
``worker_down``, ``set_drained`` and ``tick`` go in (time as arguments);
``Send`` and ``Deliver`` actions come out. ``drained`` is the set of workers
an operator has taken out of rotation; ``suspected`` the set of workers that
have gone quiet (``set_suspected``).

Per request: QUEUED (in ``queue``, see ``protocol/capacity.py``) -> HANDOFF
(sent to a prefill/decode pair, no token yet) -> STREAMING (tokens arriving)
-> ended.

Contracts:
- Over-length input is rejected before anything is sent to a worker (L1).
- Then the tenant's quotas: a full queue or an empty token bucket answers 429
  with ``Retry-After`` at once; otherwise the request waits in its tenant's
  queue. Requests leave the queue in weighted fair order, only for a pair
  with room for them (``DispatchLimits``), and the dispatcher runs again on
  every event that may make room: a request's handoff or life ending, a
  Hello, a worker joining or leaving, an undrain, a tick.
- A request waits rather than fails while workers restart: it gets 503 only
  when no worker can serve it (every worker of a role drained, no pool in
  rotation large enough), or once a role has had no live worker for
  ``DispatchLimits.worker_grace`` seconds.
- A client that leaves while queued is simply removed. Queue time never
  counts toward the silence timeout.
- An error from either leg ends the request with that error (L2); a request
  that any leg rejected never delivers a token afterwards.
- A client that leaves during HANDOFF has its cancel to decode held back
  until the handoff ends (L7), so no KV transfer is torn down mid-flight;
  prefill hears at once (``Cancel``), stops computing between chunks, and
  ends the handoff with a Reject (and a Fail to decode) once its writes have
  drained.
- Every request ends exactly once: with a finished output or an error.
- A drained worker is never picked for a new request; its requests in flight
  go on as before. With every worker of a role drained, a new request gets 503.
- Outputs are delivered in order, each once: a repeated one is ignored, and a
  gap (an output lost on the way) ends the request with a 503, never a 200
  with tokens missing.
- A request that hears nothing from its workers for ``silence_timeout``
  seconds (``tick``) ends with a 503; a lost message never hangs a client.

Faults (``worker_down``):
- A dead decode worker ends its requests; a dead prefill worker only those
  still in their handoff: a request whose KV has landed streams on.
- A request that has delivered no token is sent again, once, to a live pair
  (under a fresh wire id, so no worker confuses the two attempts); one that
  has streamed ends with a 503, never retried.
- A suspected worker gets no new request until it speaks again.
- Fencing: a worker's membership epoch moves on at each of its deaths, so
  no two incarnations share one. One declared dead for its silence
  (``fenced``) may still be running: whatever it sends under an older epoch
  is dropped and answered with ``Fenced`` (it then drops its requests and
  says Hello under the new epoch), so nothing it computed for the requests
  it held reaches a client. A restarted process (epoch 0) joins the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvfence.core import ContextLengthExceeded, KvfenceError, Request, ServiceUnavailable
from kvfence.protocol.actions import Action, Deliver, Send
from kvfence.protocol.capacity import DispatchLimits, FairQueue, QueuePolicy
from kvfence.protocol.messages import (
    Admit,
    Cancel,
    DecodeSide,
    Fenced,
    Hello,
    Message,
    Output,
    Params,
    Peers,
    Prefill,
    PrefillSide,
    Reject,
    WorkerDown,
)
from kvfence.safety import Safety

ROLES = ("prefill", "decode")


def retry_rid(rid: int) -> int:
    """The id a request's second attempt travels under: unlike its first, so no worker mistakes one for the other."""
    return rid ^ 0xFFFF


class RState(Enum):
    HANDOFF = "handoff"
    STREAMING = "streaming"


@dataclass
class RouterReq:
    rid: int  # the id on the wire: the client's, or ``retry_rid`` of it for a retry
    tenant: str
    prefill: str  # "" once the prefill worker died after the handoff
    decode: str
    request: Request = field(repr=False)  # as the client sent it, for a retry
    prompt_tokens: int = 0  # counted in its prefill worker's backlog until the handoff ends
    reserved_pages: int = 0  # counted against its decode worker's pages until it ends
    state: RState = RState.HANDOFF
    cancel_pending: bool = False
    delivered: int = 0  # completion tokens delivered so far
    heard: bool = True  # a message arrived since the last tick
    quiet_since: float | None = None

    @property
    def client(self) -> int:
        """The id the client knows the request by."""
        return self.request.rid


@dataclass
class WorkerInfo:
    """What the router knows of a live worker, from its latest Hello."""

    hello: Hello
    in_flight: int = 0
    pages_promised: int = 0  # decode: prompt pages of the requests sent to it since that Hello
    backlog_tokens: int = 0  # prefill: prompt tokens of its requests still in their handoff
    reserved_pages: int = 0  # decode: pages reserved for its requests (prompt and expected output)

    def projected_free_pages(self) -> int:
        """Free pages once the requests sent since the last Hello are granted (each for its prompt's pages), and
        no more than the reservations leave."""
        return min(self.hello.free_pages - self.pages_promised, self.usable_pages() - self.reserved_pages)

    def usable_pages(self) -> int:
        return (self.hello.total_pages or self.hello.pool_tokens) - self.hello.quarantined_pages

    def pages(self, tokens: int) -> int:
        """Pages for ``tokens`` (a Hello without a page count: count tokens)."""
        page = self.hello.pool_tokens // self.hello.total_pages if self.hello.total_pages else 1
        return -(-tokens // page)

    def promise(self, tokens: int) -> None:
        self.pages_promised += self.pages(tokens)


class RouterCore:
    def __init__(self, me: str, max_context: int, safety: Safety, silence_timeout: float = 120.0,
                 policy: QueuePolicy | None = None, limits: DispatchLimits | None = None) -> None:
        self.me, self.max_context, self.safety = me, max_context, safety
        self.silence_timeout = silence_timeout
        self.limits = limits or DispatchLimits()
        self.queue = FairQueue(policy)
        self.reqs: dict[int, RouterReq] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.drained: set[str] = set()  # worker ids; kept across a worker's death, so a restart stays drained
        self.suspected: set[str] = set()  # live workers gone quiet: no new request until they speak
        self.epochs: dict[str, int] = {}  # worker id -> its membership epoch (absent: 0), moved on at each death
        self.fenced: dict[str, int] = {}  # worker -> pid, while declared dead for silence but not known to be gone
        self.retried: set[int] = set()  # client rids on their second attempt
        self.stale_messages = 0  # dropped: sent under an epoch fenced since
        self.absent_since: dict[str, float] = {}  # role -> when it was first seen without a live worker

    # -- clients -----------------------------------------------------------------

    def submit(self, req: Request, now: float = 0.0) -> list[Action]:
        """A client's request, tokenized: L1 admission, then quotas, then the queue. Delivers its error at once, or
        queues it and dispatches what may go now."""
        self._see_roles(now)
        err = self._admission_error(req) or self._unservable(req) or self._absent_error(now) \
            or self.queue.add(req, now)
        if err is not None:
            return [Deliver(req.rid, error=err)]
        return self._dispatch()

    def client_gone(self, rid: int) -> list[Action]:
        if self.queue.withdraw(rid) is not None:
            self.retried.discard(rid)
            return []
        req = self.reqs.get(self.wire_rid(rid))
        if req is None:
            return []
        if req.state is RState.HANDOFF and self.safety.deferred_abort:
            req.cancel_pending = True  # L7: cancel decode once the handoff has ended; prefill stops computing now
            return [Send(req.prefill, Cancel(rid))]
        self._end(req)
        return [Send(req.decode, Cancel(req.rid))] + self._dispatch()

    def tick(self, now: float) -> list[Action]:
        """End every request that has heard nothing from its workers for ``silence_timeout`` seconds; fail the
        queue with 503 once a role has had no live worker for the grace period; dispatch."""
        actions: list[Action] = []
        for req in list(self.reqs.values()):
            if req.heard or req.quiet_since is None:
                req.heard, req.quiet_since = False, now
            elif now - req.quiet_since > self.silence_timeout:
                self._end(req)
                err = ServiceUnavailable(f"no word from this request's prefill and decode workers for "
                                         f"{self.silence_timeout:.0f}s", code="worker_silent")
                actions += [Send(req.decode, Cancel(req.rid)), Deliver(req.client, error=err)]
        self._see_roles(now)
        absent = self._absent_error(now)
        if absent is not None:
            actions += self._fail_queued(lambda req: absent)
        return actions + self._dispatch()

    def set_drained(self, worker: str, drained: bool) -> list[Action]:
        """Take ``worker`` out of rotation or put it back. Queued requests that no worker in rotation can serve
        any more get 503; an undrained worker gets work at once."""
        if drained:
            self.drained.add(worker)
        else:
            self.drained.discard(worker)
        return self._fail_queued(self._unservable) + self._dispatch()

    def set_suspected(self, worker: str, suspected: bool) -> list[Action]:
        """``worker`` has gone quiet (no new request goes to it), or speaks again."""
        if suspected:
            self.suspected.add(worker)
            return []
        self.suspected.discard(worker)
        return self._dispatch()

    def queued(self) -> int:
        return len(self.queue)

    def in_flight(self) -> int:
        """Requests sent to a pair and not ended."""
        return len(self.reqs)

    def client_of(self, rid: int) -> int:
        """The id the client knows in-flight request ``rid`` (a wire id: a retry's differs) by."""
        return self.reqs[rid].client

    def wire_rid(self, rid: int) -> int:
        """The id the request a client knows as ``rid`` travels under now."""
        return retry_rid(rid) if rid in self.retried else rid

    # -- workers -----------------------------------------------------------------

    def handle(self, sender: str, msg: Message, epoch: int = 0) -> list[Action]:
        """A message from ``sender`` under membership ``epoch``. One from an epoch the router has fenced is dropped
        and answered with ``Fenced``; a newer one (a router that restarted) is adopted."""
        current = self.epochs.get(sender, 0)
        if epoch < current:
            self.stale_messages += 1
            return [Send(sender, Fenced(current))]
        if epoch > current:
            self.epochs[sender] = epoch
        match msg:
            case Output():
                return self._output(sender, msg)
            case Reject():
                return self._reject(sender, msg)
            case Hello():
                return self.worker_up(msg)
        return []

    def worker_up(self, hello: Hello) -> list[Action]:
        """A Hello (first or heartbeat). Prefill workers learn of new decode targets before any request names them,
        and get the Peers again whenever their Hello shows they hold stale ones.

        A known decode worker with a new pid is a new process under the old id, restarted before its death was
        noticed: the old one goes through ``worker_down`` first, so its requests end and every prefill hears of
        the death before it hears of the new pool, and the new one is told to join under the next epoch. (Not so
        for prefill: messages queued for the dead process reach the new one, which may still act on them, so
        decode must keep waiting for its answers.)
        """
        info = self.workers.get(hello.worker)
        actions: list[Action] = []
        if info is not None and hello.role == "decode" and info.hello.pid != hello.pid:
            rejoin = Send(hello.worker, Fenced(self.epochs.get(hello.worker, 0) + 1))
            return self.worker_down(hello.worker) + [rejoin]
        if self.fenced.pop(hello.worker, hello.pid) != hello.pid:  # a new process: the fenced one is gone
            actions += [Send(w, WorkerDown(hello.worker)) for w in self.workers]
        news = info is None or info.hello.side != hello.side
        self.absent_since.pop(hello.role, None)
        if info is None:
            self.workers[hello.worker] = WorkerInfo(hello)
        else:
            info.hello, info.pages_promised = hello, 0
        peers = self._peers()
        if isinstance(hello.side, PrefillSide):  # anti-entropy: a prefill whose Peers went missing gets them again
            stale = hello.side.peers != peers.digest()
            return actions + ([Send(hello.worker, peers)] if stale else []) + self._dispatch()
        return actions + ([Send(p, peers) for p in self._role("prefill")] if news else []) + self._dispatch()

    def worker_down(self, worker: str, fenced: bool = False) -> list[Action]:
        """``worker`` died (``fenced``: was declared dead for its silence, and may still run; its epoch moves on).

        Its decode requests, and its prefill requests still in their handoff, end: one without a delivered token
        is retried once on a live pair, the rest get 503; their other legs are cancelled. A prefill worker's
        requests past their handoff stream on. Queued requests wait for a worker of its role
        (``DispatchLimits.worker_grace``). A fenced worker that turns out to have exited is announced again, so
        decode frees the pages it kept for it."""
        info = self.workers.pop(worker, None)
        if info is None:
            if fenced or self.fenced.pop(worker, None) is None:
                return []
            self.epochs[worker] += 1  # what its last incarnation sent is stale too
            return [Send(w, WorkerDown(worker)) for w in self.workers]  # decode may free what it kept for it
        self.suspected.discard(worker)
        self.epochs[worker] = self.epochs.get(worker, 0) + 1
        if fenced:
            self.fenced[worker] = info.hello.pid
        actions: list[Action] = [Send(w, WorkerDown(worker, fenced)) for w in self.workers]
        died = f"the {info.hello.role} worker serving this request died"  # no address: clients see it
        for req in list(self.reqs.values()):
            if req.prefill == worker and req.state is RState.STREAMING:
                req.prefill = ""  # its KV has landed: it streams on
            elif worker in (req.prefill, req.decode):
                actions += self._lost(req, died)
                if req.decode != worker:
                    actions.append(Send(req.decode, Cancel(req.rid)))
        return actions + self._dispatch()

    def _lost(self, req: RouterReq, died: str) -> list[Action]:
        """End ``req``, whose worker died: retry it once if it has delivered nothing, else a 503."""
        retry = req.state is RState.HANDOFF and req.client not in self.retried
        self._end(req)
        if req.cancel_pending:
            return []
        if retry:
            self.retried.add(req.client)
            self.queue.requeue(req.request)
            return []
        return [Deliver(req.client, error=ServiceUnavailable(died))]

    # -- internals ---------------------------------------------------------------

    def _output(self, sender: str, msg: Output) -> list[Action]:
        req = self.reqs.get(msg.rid)
        if req is None or sender != req.decode:
            return []
        req.heard = True
        first = msg.completion_tokens - len(msg.token_ids)  # tokens before this output's
        if first < req.delivered:
            return []  # a duplicate
        if first > req.delivered:  # an output was lost: never stream on with tokens missing
            self._end(req)
            err = ServiceUnavailable(f"lost part of the output stream (token {req.delivered} of {first})",
                                     code="output_lost")
            lost: list[Action] = [] if req.cancel_pending else [Deliver(req.client, error=err)]
            return [Send(req.decode, Cancel(req.rid)), *lost, *self._dispatch()]
        self.queue.charge(req.tenant, msg.completion_tokens - req.delivered)
        req.delivered = msg.completion_tokens
        if req.cancel_pending:  # the client left during the handoff, which has now ended
            self._end(req)
            cancel = [Send(req.decode, Cancel(req.rid))] if msg.finish_reason is None else []
            return cancel + self._dispatch()
        deliver: list[Action] = [Deliver(req.client, output=msg)]
        if msg.finish_reason is not None:
            self._end(req)
            return deliver + self._dispatch()
        if req.state is RState.HANDOFF:  # the first token: prefill is done with it
            self._handoff_ended(req)
            return deliver + self._dispatch()
        return deliver

    def _reject(self, sender: str, msg: Reject) -> list[Action]:
        req = self.reqs.get(msg.rid)
        if req is None or sender not in (req.prefill, req.decode):
            return []
        if sender == req.prefill and not self.safety.propagation:
            return []  # unsafe: like the incident's balancer, only the decode leg's status counts
        self._end(req)
        # A client that already left gets nothing, but decode must still hear that prefill gave up.
        actions: list[Action] = [] if req.cancel_pending else [Deliver(req.client, error=msg.error.to_error())]
        if sender == req.prefill:
            actions.append(Send(req.decode, Cancel(req.rid)))
        return actions + self._dispatch()

    def in_handoff(self) -> int:
        """Requests sent to a pair whose KV transfer has not yet ended (no token has come back)."""
        return sum(1 for r in self.reqs.values() if r.state is RState.HANDOFF)

    def _role(self, role: str) -> list[str]:
        return [w for w, info in self.workers.items() if info.hello.role == role]

    def _peers(self) -> Peers:
        sides = {w: info.hello.side for w, info in self.workers.items()}
        return Peers({w: side for w, side in sides.items() if isinstance(side, DecodeSide)})

    def _end(self, req: RouterReq) -> None:
        if req.state is RState.HANDOFF:
            self._handoff_ended(req)
        del self.reqs[req.rid]
        self.retried.discard(req.client)
        self.queue.ended(req.tenant)
        for w in (req.prefill, req.decode):
            if w in self.workers:
                self.workers[w].in_flight -= 1
        if req.decode in self.workers:
            self.workers[req.decode].reserved_pages -= req.reserved_pages

    def _handoff_ended(self, req: RouterReq) -> None:
        req.state = RState.STREAMING
        if req.prefill in self.workers:
            self.workers[req.prefill].backlog_tokens -= req.prompt_tokens

    def _admission_error(self, req: Request) -> KvfenceError | None:
        """L1 at the router: the context, and the largest pools any pair offers."""
        if not self.safety.admission:
            return None
        n, m = req.prompt_len, req.params.max_tokens
        if n + m > self.max_context:
            return ContextLengthExceeded(n, m, self.max_context)
        decodes = [w.hello.pool_tokens for w in self.workers.values() if w.hello.role == "decode"]
        prefills = [w.hello.pool_tokens for w in self.workers.values() if w.hello.role == "prefill"]
        if decodes and n + m > max(decodes):
            return ContextLengthExceeded(n, m, max(decodes), "decode KV pool")
        if prefills and n > max(prefills):
            return ContextLengthExceeded(n, 0, max(prefills), "prefill KV pool")
        return None

    def _unservable(self, req: Request) -> ServiceUnavailable | None:
        """503 when live workers of a role exist but none in rotation could ever take ``req``: all drained, or
        the pools of those in rotation too small (a role with no live worker at all is waited for)."""
        for role in ROLES:
            live = self._role(role)
            if live and not self._fitting(role, req):
                if not self._rotation(role):
                    return ServiceUnavailable(f"Every {role} worker is drained; try again later.")
                return ServiceUnavailable("No prefill/decode worker pair is available; try again shortly.")
        return None

    def _see_roles(self, now: float) -> None:
        for role in ROLES:
            if self._role(role):
                self.absent_since.pop(role, None)
            else:
                self.absent_since.setdefault(role, now)

    def _absent_error(self, now: float) -> ServiceUnavailable | None:
        """503 once a role has had no live worker for longer than the grace period."""
        for role, since in self.absent_since.items():
            if now - since > self.limits.worker_grace:
                return ServiceUnavailable(f"No {role} worker has been available for {now - since:.0f}s; try again "
                                          "later.", code="no_workers")
        return None

    def _fail_queued(self, error_of: Callable[[Request], KvfenceError | None]) -> list[Action]:
        """Deliver ``error_of(req)`` to every queued request it names an error for, and drop them."""
        actions: list[Action] = []
        for entry in list(self.queue.entries()):
            err = error_of(entry.req)
            if err is not None:
                actions.append(self._refuse_queued(entry.req.rid, err))
        return actions

    def _refuse_queued(self, rid: int, err: KvfenceError) -> Deliver:
        self.queue.withdraw(rid)
        self.retried.discard(rid)
        return Deliver(rid, error=err)

    def _dispatch(self) -> list[Action]:
        """Send queued requests, in the queue's order, while the next one has a pair with room for it."""
        actions: list[Action] = []
        while (entry := self.queue.next()) is not None:
            req = entry.req
            err = self._admission_error(req) or self._unservable(req)  # the pools may have changed while it waited
            if err is not None:
                actions.append(self._refuse_queued(req.rid, err))
                continue
            pair = self._pick_pair(req)
            if pair is None:
                break
            self.queue.start(entry)
            actions += self._send(req, *pair)
        return actions

    def _send(self, req: Request, prefill: str, decode: str) -> list[Action]:
        p, d = self.workers[prefill], self.workers[decode]
        reserved = self._decode_pages(d, req)
        rid = self.wire_rid(req.rid)
        self.reqs[rid] = RouterReq(rid, req.tenant, prefill, decode, req, req.prompt_len, reserved)
        p.in_flight += 1
        d.in_flight += 1
        p.backlog_tokens += req.prompt_len
        d.reserved_pages += reserved
        d.promise(req.prompt_len)
        params = Params.of(req.params)
        return [
            Send(decode, Admit(rid, req.tenant, req.prompt_ids, params, prefill, req.weight)),
            Send(prefill, Prefill(rid, req.tenant, req.prompt_ids, params, decode, req.weight,
                                  req.cache_salt, req.public_tokens)),
        ]

    def _output_reserve(self, req: Request) -> int:
        reserve = self.limits.output_reserve_tokens
        return min(req.params.max_tokens, reserve) if reserve is not None else 0

    def _decode_pages(self, w: WorkerInfo, req: Request) -> int:
        """Pages ``req`` reserves on decode ``w``: its prompt and output reserve, and for each further choice a
        copy of the prompt's last page and its own output reserve (the prompt's full pages are shared)."""
        reserve = self._output_reserve(req)
        return w.pages(req.prompt_len + reserve) + (req.params.n - 1) * (1 + w.pages(reserve))

    def _pick_pair(self, req: Request) -> tuple[str, str] | None:
        """Among the workers that fit the request and have room for it now: the least-loaded prefill by backlog,
        the decode with the most projected free pages."""
        prefills = [w for w in self._fitting("prefill", req) if self._prefill_has_room(w) and self._trusted(w)]
        decodes = [w for w in self._fitting("decode", req) if self._decode_has_room(w, req) and self._trusted(w)]
        if not prefills or not decodes:
            return None
        prefill = min(prefills, key=lambda w: (w.backlog_tokens, w.hello.queued_tokens, w.hello.worker))
        decode = min(decodes, key=lambda w: (-w.projected_free_pages(), w.in_flight, w.hello.worker))
        return prefill.hello.worker, decode.hello.worker

    def _fitting(self, role: str, req: Request) -> list[WorkerInfo]:
        """The workers of ``role`` in rotation whose pool could hold ``req`` (prefill: its prompt; decode: all)."""
        n = req.prompt_len + (req.params.max_tokens if role == "decode" else 0)
        return [w for w in self._rotation(role) if n <= w.hello.pool_tokens or not self.safety.admission]

    def _prefill_has_room(self, w: WorkerInfo) -> bool:
        bound = self.limits.prefill_backlog_tokens
        return bound is None or w.backlog_tokens == 0 or w.backlog_tokens < bound

    def _decode_has_room(self, w: WorkerInfo, req: Request) -> bool:
        if self.limits.output_reserve_tokens is None or w.in_flight == 0:
            return True
        return w.reserved_pages + self._decode_pages(w, req) <= w.usable_pages()

    def _trusted(self, w: WorkerInfo) -> bool:
        return w.hello.worker not in self.suspected

    def _rotation(self, role: str) -> list[WorkerInfo]:
        """The live workers of ``role`` that are not drained."""
        return [w for w in self.workers.values() if w.hello.role == role and w.hello.worker not in self.drained]
