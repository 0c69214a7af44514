"""Decode's protocol core: grants pages, waits for the transfer, hands over to the engine.

Sans-IO: ``handle`` (a message), ``tick`` (time), ``engine_output`` and
``peer_down`` go in; actions come out. The page table is the only state it
shares, with the engine's scheduler, on the same thread.

Per request: WAITING (no pages yet) -> AWAIT_DONE (Dest sent) -> DECODING
(engine owns the pages); on abort or timeout AWAIT_DONE -> ABORTING until
Done or AbortAck proves no write can still land.

Timeouts: the handoff timeout measures the handoff itself, from the grant
(Dest sent) to Done, and every ``Progress`` from the writer (a chunk of the
prompt computed) starts it again; waiting for pages does not count. A request
still WAITING after ``page_wait_timeout`` ends with a 503 (and a Fail to
prefill), so nothing waits for ever.

Order: WAITING requests get pages in weighted fair order (``FairShares``:
prompt tokens granted and completion tokens produced, per tenant, divided by
the request's ``weight``; oldest first within a tenant). The head waits until
its pages are free: it is never overtaken.

Contracts:
- Pages granted for a transfer are freed only after Done, Fail or AbortAck
  from the writer, or after its death; a silent writer's pages are
  quarantined, never reused (L6), until it speaks or dies.
- A Done is accepted only if it covers exactly the prompt (L4) and the
  landed pages pass ``verify`` (L3 tags, L5 checksums); otherwise the client
  gets a 500 and the pages are quarantined until the writer answers an
  Abort (its AbortAck says no write for the request follows) or dies, so
  one bad transfer cannot drain the pool.
- Every request that ends here without finishing normally sends the router
  a Reject, unless the router itself cancelled it.
- A writer the router fenced (declared dead for its silence) may still be
  running: the pages it was writing stay quarantined until it answers for
  them or is known to have exited. Fenced itself (``drop_all``), this worker
  ends every request as a cancel would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvfence.core import ContextLengthExceeded, IntegrityError, KvfenceError, ServiceUnavailable
from kvfence.kvcache.pages import PageGrant, PageState, PageTable
from kvfence.protocol.actions import Action, Send, StartDecode, StopDecode
from kvfence.protocol.capacity import FairShares
from kvfence.protocol.messages import (
    Abort,
    AbortAck,
    Admit,
    Cancel,
    Dest,
    Done,
    ErrorInfo,
    Fail,
    Message,
    Output,
    Progress,
    Reject,
)
from kvfence.safety import Safety, layer_of

# verify(rid, grants, expected_tokens, claimed_checksum) -> None when the landed pages are good, else what is wrong,
# prefixed with the layer that caught it ("tags: page 3: ...").
Verifier = Callable[[int, list[PageGrant], int, int], str | None]


class DState(Enum):
    WAITING = "waiting"
    AWAIT_DONE = "await_done"
    ABORTING = "aborting"
    DECODING = "decoding"


@dataclass
class DecodeReq:
    msg: Admit
    prefill: str
    state: DState = DState.WAITING
    grants: list[PageGrant] = field(default_factory=list)
    deadline: float = 0.0

    @property
    def rid(self) -> int:
        return self.msg.rid


@dataclass(frozen=True)
class DecodeLimits:
    max_context: int
    page_size: int
    handoff_timeout: float = 30.0  # pages granted -> Done, restarted by each Progress
    abort_timeout: float = 10.0  # Abort -> AbortAck; then quarantine
    page_wait_timeout: float = 120.0  # Admit -> pages granted
    fair: bool = True  # pages go in tenants' fair order (False: first come, first served)


class DecodeCore:
    def __init__(self, me: str, router: str, pages: PageTable, limits: DecodeLimits, safety: Safety,
                 verify: Verifier) -> None:
        self.me, self.router, self.pages, self.limits, self.safety = me, router, pages, limits, safety
        self.verify = verify
        self.reqs: dict[int, DecodeReq] = {}
        self.waiting: list[int] = []  # rids WAITING, in arrival order; granted in fair order
        self.shares = FairShares(limits.fair)
        self.held: dict[int, tuple[str, list[int]]] = {}  # rid -> (writer, pages) quarantined until the writer speaks

    @property
    def pool_tokens(self) -> int:
        return self.pages.num_pages * self.limits.page_size

    def prefill_pending(self) -> bool:
        """Whether some prefill worker may be computing or writing KV for one of this worker's requests."""
        return any(r.state is not DState.DECODING for r in self.reqs.values())

    def granted_pages(self) -> list[int]:
        """Every page granted to a request this core still tracks (the engine's integrity check: each is owned)."""
        return [g.page for r in self.reqs.values() for g in r.grants]

    def handle(self, sender: str, msg: Message, now: float) -> list[Action]:
        actions: list[Action] = []
        match msg:
            case Admit():
                actions = self._admit(msg, now)
            case Done():
                actions = self._done(sender, msg)
            case Progress():
                self._progress(sender, msg, now)
            case Fail():
                actions = self._writer_finished(msg.rid, sender, msg.error)
            case AbortAck():
                actions = self._writer_finished(msg.rid, sender, None)
            case Cancel():
                actions = self._cancel(msg.rid, now)
        return actions + self._grant_waiting(now)  # anything above may have freed pages

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for req in list(self.reqs.values()):
            if req.state is DState.WAITING and now >= req.deadline:
                self.waiting.remove(req.rid)
                del self.reqs[req.rid]
                err = ServiceUnavailable(f"no KV pages became free within {self.limits.page_wait_timeout}s")
                actions += [self._reject(req.rid, err), Send(req.prefill, Fail(req.rid, ErrorInfo.of(err)))]
            elif req.state is DState.AWAIT_DONE and now >= req.deadline:
                err = ServiceUnavailable("the prefill worker did not finish the KV transfer in time")
                actions += [self._reject(req.rid, err), *self._abort(req, now)]
            elif req.state is DState.ABORTING and now >= req.deadline:
                self._hold(req, f"no Done/AbortAck from {req.prefill} within {self.limits.abort_timeout}s")
        return actions + self._grant_waiting(now)

    def engine_output(self, out: Output | Reject, now: float) -> list[Action]:
        """The engine produced tokens, or ended the request (freeing its pages itself)."""
        ended = isinstance(out, Reject) or out.finish_reason is not None
        req = self.reqs.pop(out.rid, None) if ended else self.reqs.get(out.rid)
        if req is not None and isinstance(out, Output):
            self.shares.charge(req.msg.tenant, len(out.token_ids), req.msg.weight)
        actions: list[Action] = [Send(self.router, out)]
        return actions + (self._grant_waiting(now) if ended else [])

    def peer_down(self, worker: str, now: float, fenced: bool = False) -> list[Action]:
        """``worker`` is dead: none of its writes can land any more; or (``fenced``) it was declared dead but may
        still write, so with L6 the pages it was writing are quarantined until it answers for them."""
        hold = fenced and self.safety.deferred_release
        actions: list[Action] = []
        for req in list(self.reqs.values()):
            if req.prefill == worker and req.state in (DState.AWAIT_DONE, DState.ABORTING):
                if req.state is DState.AWAIT_DONE:
                    actions.append(self._reject(req.rid, ServiceUnavailable("the prefill worker died")))
                if hold:
                    self._hold(req, f"{worker} was declared dead but may still write")
                else:
                    self._release(req)
        for rid, (writer, _) in list(self.held.items()):
            if writer == worker and not hold:
                self._writer_heard(rid, worker)
        return actions + self._grant_waiting(now)

    def drop_all(self, now: float) -> list[Action]:
        """The router fenced this worker and ended its requests: cancel each (no Reject), pages freed under L6."""
        actions = [a for rid in list(self.reqs) for a in self._cancel(rid, now)]
        return actions + self._grant_waiting(now)

    # -- events ---------------------------------------------------------------------

    def _admit(self, msg: Admit, now: float) -> list[Action]:
        if msg.rid in self.reqs:
            return []  # duplicate
        err = self._admission_error(msg)
        if err is not None:
            return [self._reject(msg.rid, err), Send(msg.prefill, Fail(msg.rid, ErrorInfo.of(err)))]
        if not any(self.reqs[rid].msg.tenant == msg.tenant for rid in self.waiting):
            self.shares.resume(msg.tenant)  # back after idling: no credit for the idle time
        self.reqs[msg.rid] = DecodeReq(msg, msg.prefill, deadline=now + self.limits.page_wait_timeout)
        self.waiting.append(msg.rid)
        return []

    def _admission_error(self, msg: Admit) -> KvfenceError | None:
        """L1: the whole request must fit the context and this pool, checked before any grant."""
        limit = min(self.limits.max_context, self.pool_tokens)
        n = len(msg.prompt_ids)
        if n + msg.params.max_tokens > limit and self.safety.admission:
            return ContextLengthExceeded(n, msg.params.max_tokens, limit)
        if self._pages_for(n) > self.pages.num_pages:
            return ContextLengthExceeded(n, msg.params.max_tokens, self.pool_tokens, "decode KV pool")
        return None

    def _grant_waiting(self, now: float) -> list[Action]:
        actions: list[Action] = []
        while self.waiting:
            req = min((self.reqs[rid] for rid in self.waiting), key=lambda r: self.shares.counter(r.msg.tenant))
            need = self._pages_for(len(req.msg.prompt_ids))
            if not self.pages.can_grant(need):
                break
            self.waiting.remove(req.rid)
            self.shares.start(req.msg.tenant, len(req.msg.prompt_ids), req.msg.weight)
            req.grants = self.pages.grant(req.rid, need)
            self.pages.set_state(req.rid, req.grants, PageState.WRITING)
            req.state, req.deadline = DState.AWAIT_DONE, now + self.limits.handoff_timeout
            dest = Dest(req.rid, [(g.page, g.epoch) for g in req.grants], len(req.msg.prompt_ids))
            actions.append(Send(req.prefill, dest))
        return actions

    def _done(self, sender: str, msg: Done) -> list[Action]:
        req = self.reqs.get(msg.rid)
        if req is None or sender != req.prefill:
            self._writer_heard(msg.rid, sender)
            return []  # late Done for a request that already ended
        if req.state is DState.ABORTING:
            return self._writer_finished(msg.rid, sender, None)
        if req.state is not DState.AWAIT_DONE:
            return []
        problem = self._landing_problem(req, msg)
        if problem is not None:
            self._hold(req, problem)
            err = IntegrityError(f"KV transfer failed verification: {problem}", layer=layer_of(problem))
            return [self._reject(req.rid, err), Send(req.prefill, Abort(req.rid))]
        self.pages.set_state(req.rid, req.grants, PageState.READY)
        req.state = DState.DECODING
        grants, req.grants = req.grants, []
        return [StartDecode(req.msg, grants, msg)]

    def _progress(self, sender: str, msg: Progress, now: float) -> None:
        """The writer computed more of the prompt: the handoff is alive, its timeout starts again."""
        req = self.reqs.get(msg.rid)
        if req is not None and sender == req.prefill and req.state is DState.AWAIT_DONE:
            req.deadline = max(req.deadline, now + self.limits.handoff_timeout)

    def _landing_problem(self, req: DecodeReq, msg: Done) -> str | None:
        expected = len(req.msg.prompt_ids)
        if msg.tokens != expected and self.safety.coverage:
            return f"coverage: {msg.tokens} tokens written, {expected} expected"
        return self.verify(req.rid, req.grants, expected, msg.checksum)

    def _writer_finished(self, rid: int, sender: str, error: ErrorInfo | None) -> list[Action]:
        """Fail or AbortAck (or Done while aborting): the writer promises no write follows."""
        req = self.reqs.get(rid)
        if req is None or sender != req.prefill or req.state not in (DState.AWAIT_DONE, DState.ABORTING):
            self._writer_heard(rid, sender)
            return []
        actions: list[Action] = []
        if req.state is DState.AWAIT_DONE and error is not None:
            actions.append(Send(self.router, Reject(rid, error, self.me)))
        self._release(req)
        return actions

    def _cancel(self, rid: int, now: float) -> list[Action]:
        req = self.reqs.get(rid)
        if req is None:
            return []
        if req.state is DState.WAITING:
            self.waiting.remove(rid)
            del self.reqs[rid]
            return [Send(req.prefill, Fail(rid, ErrorInfo.of(KvfenceError("cancelled"))))]
        if req.state is DState.DECODING:
            del self.reqs[rid]
            return [StopDecode(rid)]
        if req.state is DState.AWAIT_DONE:
            return self._abort(req, now)
        return []

    # -- endings ----------------------------------------------------------------------

    def _abort(self, req: DecodeReq, now: float) -> list[Action]:
        """Ask the writer to stop. With L6 the pages wait for its answer; without, they are freed now."""
        actions: list[Action] = [Send(req.prefill, Abort(req.rid))]
        if self.safety.deferred_release:
            req.state, req.deadline = DState.ABORTING, now + self.limits.abort_timeout
        else:
            self._release(req)
        return actions

    def _release(self, req: DecodeReq) -> None:
        self.pages.free(req.rid, req.grants)
        self._forget(req)

    def _hold(self, req: DecodeReq, reason: str) -> None:
        """Quarantine the request's pages until its writer speaks (Done, Fail, AbortAck) or dies."""
        self.held[req.rid] = (req.prefill, [g.page for g in req.grants])
        self.pages.quarantine(req.rid, req.grants, reason)
        self._forget(req)

    def _forget(self, req: DecodeReq) -> None:
        req.grants = []
        del self.reqs[req.rid]

    def _writer_heard(self, rid: int, writer: str) -> None:
        """The writer of held pages answered (or died): no write of its can land there any more."""
        entry = self.held.get(rid)
        if entry is not None and entry[0] == writer:
            del self.held[rid]
            for page in entry[1]:
                self.pages.release_quarantine(page)

    def _reject(self, rid: int, err: KvfenceError) -> Send:
        return Send(self.router, Reject(rid, ErrorInfo.of(err), self.me))

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.limits.page_size)
