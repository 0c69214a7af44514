"""Prefill's protocol core: pairs each prompt with decode's Dest, starts compute, reports the end.

Sans-IO: ``handle`` (a message), ``tick`` (time), ``computed``,
``compute_failed`` and ``peer_down`` go in; actions come out.

Per request: WAIT_DEST (prompt here, no Dest yet) or WAIT_PREFILL (Dest
came first) -> COMPUTING -> ends with Done; an Abort while computing moves it
to ABORTING, which ends with AbortAck once the runner reports that no write
can still land. A Cancel from the router (its client left during the handoff,
L7) moves COMPUTING to CANCELLING, which ends with Fail to decode and Reject
to the router once the runner has drained; a request still waiting for its
Dest ends at once with a Reject.

Contracts:
- Done, Fail and AbortAck are each sent only when no write for the request
  is in flight or will be issued (with L6 on).
- An over-length prompt is rejected before compute and before any write (L1):
  Reject to the router and Fail to decode, so decode frees its pages. Under
  ``emulate_incident`` (test-only) it is rejected to the router but a 1-token
  placeholder still runs and reports Done, as in the incident (docs/safety.md).
- A Dest whose expected length differs from the real prompt is refused (L4).
- An Abort or Dest for a request this worker does not know is answered at
  once (AbortAck, or Fail after a grace period), so decode never waits in vain.
- Work stops between chunks once a request is aborted or cancelled
  (``StopPrefill``); while it computes, every chunk computed sends decode a
  ``Progress`` (``progress``), which keeps its handoff timeout from firing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import msgspec

from kvfence.core import ContextLengthExceeded, IntegrityError, KvfenceError, ServiceUnavailable, TokenLogprob
from kvfence.protocol.actions import Action, Send, StartPrefill, StopPrefill
from kvfence.protocol.messages import (
    Abort,
    AbortAck,
    Cancel,
    Dest,
    Done,
    ErrorInfo,
    Fail,
    Message,
    Prefill,
    Progress,
    Reject,
)
from kvfence.safety import Safety

CANCELLED = KvfenceError("cancelled: the client left")


class PState(Enum):
    WAIT_DEST = "wait_dest"
    WAIT_PREFILL = "wait_prefill"
    COMPUTING = "computing"
    ABORTING = "aborting"  # computing, Abort received: ack when the runner stops
    CANCELLING = "cancelling"  # computing, Cancel received: Fail and Reject when the runner stops
    ACKED = "acked"  # computing, but already acked (only without L6: the unsafe path)


@dataclass
class PrefillReq:
    rid: int
    decode: str  # who sent or will send the Dest
    msg: Prefill | None = None
    dest: Dest | None = None
    state: PState = PState.WAIT_DEST
    deadline: float = 0.0


@dataclass(frozen=True)
class PrefillLimits:
    max_context: int
    pool_tokens: int
    page_size: int
    dest_timeout: float = 30.0  # Prefill -> Dest
    orphan_dest_timeout: float = 5.0  # Dest with no Prefill yet


class PrefillCore:
    def __init__(self, me: str, router: str, limits: PrefillLimits, safety: Safety,
                 emulate_incident: bool = False) -> None:
        self.me, self.router, self.limits, self.safety = me, router, limits, safety
        self.emulate_incident = emulate_incident
        self.reqs: dict[int, PrefillReq] = {}

    def handle(self, sender: str, msg: Message, now: float) -> list[Action]:
        match msg:
            case Prefill():
                return self._prefill(msg, now)
            case Dest():
                return self._dest(sender, msg, now)
            case Abort():
                return self._abort(sender, msg.rid)
            case Fail():
                return self._peer_failed(sender, msg.rid)
            case Cancel():
                return self._cancel(sender, msg.rid)
        return []

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for req in list(self.reqs.values()):
            if now < req.deadline:
                continue
            if req.state is PState.WAIT_DEST:
                err = ServiceUnavailable("the decode worker never assigned KV pages")
                actions.append(self._reject(req.rid, err))
                del self.reqs[req.rid]
            elif req.state is PState.WAIT_PREFILL:
                err = ServiceUnavailable("no such request on this prefill worker (its Prefill was lost)")
                actions.append(Send(req.decode, Fail(req.rid, ErrorInfo.of(err))))
                del self.reqs[req.rid]
        return actions

    def progress(self, rid: int, tokens: int) -> list[Action]:
        """The runner computed another chunk of ``rid`` (``tokens`` so far): tell decode the handoff is alive."""
        req = self.reqs.get(rid)
        if req is None or req.state is not PState.COMPUTING:
            return []
        return [Send(req.decode, Progress(rid, tokens))]

    def computed(self, rid: int, tokens: int, checksum: int, first_token: int,
                 first_logprob: TokenLogprob | None = None, prompt_logprobs: list[TokenLogprob] | None = None,
                 more: Sequence[tuple[int, TokenLogprob | None]] = (), cached_tokens: int = 0) -> list[Action]:
        """The runner finished: every write has landed. ``more``: the first tokens of choices 1..n-1;
        ``cached_tokens``: prompt tokens it read from its prefix cache rather than computed."""
        req = self.reqs.pop(rid)
        if req.state is PState.COMPUTING:
            logprobs = [lp for _, lp in more] if first_logprob is not None else []
            return [Send(req.decode, Done(rid, tokens, checksum, first_token, first_logprob, prompt_logprobs,
                                          [t for t, _ in more], logprobs, cached_tokens))]
        if req.state is PState.ABORTING:
            return [Send(req.decode, AbortAck(rid))]
        if req.state is PState.CANCELLING:
            return self._fail(req, CANCELLED)
        return []

    def compute_failed(self, rid: int, err: KvfenceError) -> list[Action]:
        """The runner gave up (e.g. the data plane broke); no write of this request can still land."""
        req = self.reqs.pop(rid)
        if req.state is PState.ABORTING:
            return [Send(req.decode, AbortAck(rid))]
        if req.state is PState.ACKED:
            return []
        return self._fail(req, CANCELLED if req.state is PState.CANCELLING else err)

    def peer_down(self, worker: str) -> list[Action]:
        """Decode ``worker`` died: stop work for it and tell the router."""
        actions: list[Action] = []
        for req in list(self.reqs.values()):
            if req.decode != worker:
                continue
            if req.state is PState.COMPUTING:  # an AbortAck once stopped, should a fenced decode come back and ask
                req.state = PState.ABORTING if self.safety.deferred_release else PState.ACKED
                actions += [StopPrefill(req.rid), self._reject(req.rid, ServiceUnavailable("the decode worker died"))]
            elif req.state in (PState.WAIT_DEST, PState.WAIT_PREFILL):
                if req.msg is not None:
                    actions.append(self._reject(req.rid, ServiceUnavailable("the decode worker died")))
                del self.reqs[req.rid]
        return actions

    def drop_all(self) -> list[Action]:
        """The router fenced this worker and ended its requests: abort each as decode would ask (no Reject)."""
        return [a for rid, req in list(self.reqs.items()) for a in self._abort(req.decode, rid)]

    # -- events -------------------------------------------------------------------

    def _prefill(self, msg: Prefill, now: float) -> list[Action]:
        req = self.reqs.get(msg.rid)
        if req is not None and req.msg is not None:
            return []  # duplicate
        actions: list[Action] = []
        err = self._admission_error(msg)
        if err is not None and self.emulate_incident:
            # The incident (docs/safety.md): the request is rejected, yet a 1-token placeholder is still
            # computed and its transfer reported complete, into pages decode granted for the whole prompt.
            actions.append(self._reject(msg.rid, err))
            msg = msgspec.structs.replace(msg, prompt_ids=[0])
        elif err is not None and self.safety.admission:
            self.reqs.pop(msg.rid, None)
            return [self._reject(msg.rid, err), Send(msg.decode, Fail(msg.rid, ErrorInfo.of(err)))]
        if req is None:
            self.reqs[msg.rid] = PrefillReq(msg.rid, msg.decode, msg, deadline=now + self.limits.dest_timeout)
            return actions
        req.msg = msg
        return actions + self._start(req)

    def _admission_error(self, msg: Prefill) -> KvfenceError | None:
        n = len(msg.prompt_ids)
        if n + msg.params.max_tokens > self.limits.max_context:
            return ContextLengthExceeded(n, msg.params.max_tokens, self.limits.max_context)
        if n > self.limits.pool_tokens:
            return ContextLengthExceeded(n, 0, self.limits.pool_tokens, "prefill KV pool")
        return None

    def _dest(self, sender: str, msg: Dest, now: float) -> list[Action]:
        req = self.reqs.get(msg.rid)
        if req is None:
            deadline = now + self.limits.orphan_dest_timeout
            self.reqs[msg.rid] = PrefillReq(msg.rid, sender, dest=msg, state=PState.WAIT_PREFILL, deadline=deadline)
            return []
        if req.state is not PState.WAIT_DEST or sender != req.decode:
            return []  # duplicate or foreign
        req.dest = msg
        return self._start(req)

    def _start(self, req: PrefillReq) -> list[Action]:
        assert req.msg is not None and req.dest is not None
        n, dest = len(req.msg.prompt_ids), req.dest
        room = len(dest.pages) * self.limits.page_size
        if (dest.expected_tokens != n or room < n) and self.safety.coverage:
            del self.reqs[req.rid]
            err = IntegrityError(f"decode expects {dest.expected_tokens} tokens in {room} slots; the prompt has {n}",
                                 layer="coverage")
            return [Send(req.decode, Fail(req.rid, ErrorInfo.of(err))), self._reject(req.rid, err)]
        req.state = PState.COMPUTING
        return [StartPrefill(req.rid, req.msg.prompt_ids, dest.pages, req.decode, req.msg)]

    def _abort(self, sender: str, rid: int) -> list[Action]:
        req = self.reqs.get(rid)
        if req is None or req.state in (PState.WAIT_DEST, PState.WAIT_PREFILL):
            self.reqs.pop(rid, None)
            return [Send(sender, AbortAck(rid))]
        if req.state is not PState.COMPUTING:
            return []
        if self.safety.deferred_release:
            req.state = PState.ABORTING
            return [StopPrefill(rid)]
        req.state = PState.ACKED  # unsafe: acknowledges while writes may still land
        return [StopPrefill(rid), Send(sender, AbortAck(rid))]

    def _cancel(self, sender: str, rid: int) -> list[Action]:
        """The router's client left during the handoff: stop computing between chunks; nothing is torn down
        before the runner has drained (Fail promises decode that no write follows)."""
        req = self.reqs.get(rid)
        if req is None or sender != self.router or req.msg is None:
            return []
        if req.state is PState.WAIT_DEST:  # nothing computed, nothing written; decode hears from the router
            del self.reqs[rid]
            return [self._reject(rid, CANCELLED)]
        if req.state is PState.COMPUTING:
            req.state = PState.CANCELLING
            return [StopPrefill(rid)]
        return []

    def _peer_failed(self, sender: str, rid: int) -> list[Action]:
        """Decode failed the request before sending a Dest (e.g. its own admission)."""
        req = self.reqs.get(rid)
        if req is not None and req.decode == sender and req.state in (PState.WAIT_DEST, PState.WAIT_PREFILL):
            del self.reqs[rid]
        return []

    def _fail(self, req: PrefillReq, err: KvfenceError) -> list[Action]:
        return [Send(req.decode, Fail(req.rid, ErrorInfo.of(err))), self._reject(req.rid, err)]

    def _reject(self, rid: int, err: KvfenceError) -> Send:
        return Send(self.router, Reject(rid, ErrorInfo.of(err), self.me))
