"""Router's protocol core: admission, pairing, and turning worker messages into client results.

Sans-IO: ``submit``, ``client_gone``, ``handle``, ``worker_up`` and
``worker_down`` go in; ``Send`` and ``Deliver`` actions come out. ``drained``
is the set of workers an operator has taken out of rotation.

Per request: HANDOFF (sent to a prefill/decode pair, no token yet) ->
STREAMING (tokens arriving) -> ended.

Contracts:
- Over-length input is rejected before anything is sent to a worker (L1).
- An error from either leg ends the request with that error (L2); a request
  that any leg rejected never delivers a token afterwards.
- A client that leaves during HANDOFF has its cancel held back until the
  handoff ends (L7), so no KV transfer is torn down mid-flight.
- Every request ends exactly once: with a finished output or an error.
- A drained worker is never picked for a new request; its requests in flight
  go on as before. With every worker of a role drained, a new request gets 503.
- Outputs are delivered in order, each once: a repeated one is ignored, and a
  gap (an output lost on the way) ends the request with a 503, never a 200
  with tokens missing.
- A request that hears nothing from its workers for ``silence_timeout``
  seconds (``tick``) ends with a 503; a lost message never hangs a client.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvfence.core import ContextLengthExceeded, KvfenceError, Request, ServiceUnavailable
from kvfence.protocol.actions import Action, Deliver, Send
from kvfence.protocol.messages import Admit, Cancel, Hello, Message, Output, Params, Peers, Prefill, Reject, WorkerDown
from kvfence.safety import Safety


class RState(Enum):
    HANDOFF = "handoff"
    STREAMING = "streaming"


@dataclass
class RouterReq:
    rid: int
    tenant: str
    prefill: str
    decode: str
    state: RState = RState.HANDOFF
    cancel_pending: bool = False
    delivered: int = 0  # completion tokens delivered so far
    heard: bool = True  # a message arrived since the last tick
    quiet_since: float | None = None


@dataclass
class WorkerInfo:
    """What the router knows of a live worker, from its latest Hello."""

    hello: Hello
    in_flight: int = 0
    pages_promised: int = 0  # decode: prompt pages of the requests sent to it since that Hello

    def projected_free_pages(self) -> int:
        """Free pages once the requests sent since the last Hello are granted: each counts for its prompt's
        pages, not as one page whatever its length."""
        return self.hello.free_pages - self.pages_promised

    def promise(self, tokens: int) -> None:
        # a Hello without a page count: count tokens
        page = self.hello.pool_tokens // self.hello.total_pages if self.hello.total_pages else 1
        self.pages_promised += -(-tokens // page)


class RouterCore:
    def __init__(self, me: str, max_context: int, safety: Safety, silence_timeout: float = 120.0) -> None:
        self.me, self.max_context, self.safety = me, max_context, safety
        self.silence_timeout = silence_timeout
        self.reqs: dict[int, RouterReq] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.drained: set[str] = set()  # worker ids; kept across a worker's death, so a restart stays drained

    # -- clients -----------------------------------------------------------------

    def submit(self, req: Request) -> list[Action]:
        """A client's request, tokenized. Either sends it to a pair, or delivers its error at once."""
        err = self._admission_error(req)
        if err is None:
            pair = self._pick_pair(req)
            if pair is None:
                err = self._no_pair_error()
        if err is not None:
            return [Deliver(req.rid, error=err)]
        prefill, decode = pair
        self.reqs[req.rid] = RouterReq(req.rid, req.tenant, prefill, decode)
        idle_pair = self.workers[prefill].in_flight == self.workers[decode].in_flight == 0
        self.workers[prefill].in_flight += 1
        self.workers[decode].in_flight += 1
        self.workers[decode].promise(req.prompt_len)
        params = Params.of(req.params)
        return [
            Send(decode, Admit(req.rid, req.tenant, req.prompt_ids, params, prefill)),
            Send(prefill, Prefill(req.rid, req.tenant, req.prompt_ids, params, decode, idle_pair)),
        ]

    def client_gone(self, rid: int) -> list[Action]:
        req = self.reqs.get(rid)
        if req is None:
            return []
        if req.state is RState.HANDOFF and self.safety.deferred_abort:
            req.cancel_pending = True  # L7: cancel once the handoff has ended
            return []
        self._end(req)
        return [Send(req.decode, Cancel(rid))]

    def tick(self, now: float) -> list[Action]:
        """End every request that has heard nothing from its workers for ``silence_timeout`` seconds."""
        actions: list[Action] = []
        for req in list(self.reqs.values()):
            if req.heard or req.quiet_since is None:
                req.heard, req.quiet_since = False, now
            elif now - req.quiet_since > self.silence_timeout:
                self._end(req)
                err = ServiceUnavailable(f"no word from this request's prefill and decode workers for "
                                         f"{self.silence_timeout:.0f}s", code="worker_silent")
                actions += [Send(req.decode, Cancel(req.rid)), Deliver(req.rid, error=err)]
        return actions

    # -- workers -----------------------------------------------------------------

    def handle(self, sender: str, msg: Message) -> list[Action]:
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
        the death before it hears of the new pool. (Not so for prefill: messages queued for the dead process
        reach the new one, which may still act on them, so decode must keep waiting for its answers.)
        """
        info = self.workers.get(hello.worker)
        actions: list[Action] = []
        if info is not None and hello.role == "decode" and info.hello.pid != hello.pid:
            actions, info = self.worker_down(hello.worker), None
        news = info is None or info.hello.data != hello.data
        if info is None:
            self.workers[hello.worker] = WorkerInfo(hello)
        else:
            info.hello, info.pages_promised = hello, 0
        peers = self._peers()
        if hello.role == "prefill":  # anti-entropy: a prefill whose Peers went missing gets them again
            stale = hello.data.get("peers") != peers.digest()
            return actions + ([Send(hello.worker, peers)] if stale else [])
        return actions + ([Send(p, peers) for p in self._role("prefill")] if news else [])

    def worker_down(self, worker: str) -> list[Action]:
        """``worker`` died: its requests end with a 503 now; their other legs are cancelled."""
        info = self.workers.pop(worker, None)
        if info is None:
            return []
        actions: list[Action] = [Send(w, WorkerDown(worker)) for w in self.workers]
        died = f"the {info.hello.role} worker serving this request died"  # no address: clients see it
        for req in list(self.reqs.values()):
            if worker in (req.prefill, req.decode):
                self._end(req)
                actions.append(Deliver(req.rid, error=ServiceUnavailable(died)))
                if req.decode != worker:
                    actions.append(Send(req.decode, Cancel(req.rid)))
        return actions

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
            return [Send(req.decode, Cancel(req.rid))] + ([] if req.cancel_pending else [Deliver(req.rid, error=err)])
        req.delivered = msg.completion_tokens
        actions: list[Action] = []
        if req.cancel_pending:  # the client left during the handoff, which has now ended
            self._end(req)
            if msg.finish_reason is None:
                actions.append(Send(req.decode, Cancel(req.rid)))
            return actions
        req.state = RState.STREAMING
        if msg.finish_reason is not None:
            self._end(req)
        return [Deliver(msg.rid, output=msg)]

    def _reject(self, sender: str, msg: Reject) -> list[Action]:
        req = self.reqs.get(msg.rid)
        if req is None or sender not in (req.prefill, req.decode):
            return []
        if sender == req.prefill and not self.safety.propagation:
            return []  # unsafe: like the incident's balancer, only the decode leg's status counts
        self._end(req)
        # A client that already left gets nothing, but decode must still hear that prefill gave up.
        actions: list[Action] = [] if req.cancel_pending else [Deliver(req.rid, error=msg.error.to_error())]
        if sender == req.prefill:
            actions.append(Send(req.decode, Cancel(req.rid)))
        return actions

    def in_handoff(self) -> int:
        """Requests sent to a pair whose KV transfer has not yet ended (no token has come back)."""
        return sum(1 for r in self.reqs.values() if r.state is RState.HANDOFF)

    def _role(self, role: str) -> list[str]:
        return [w for w, info in self.workers.items() if info.hello.role == role]

    def _peers(self) -> Peers:
        return Peers({w: self.workers[w].hello.data for w in self._role("decode")})

    def _end(self, req: RouterReq) -> None:
        del self.reqs[req.rid]
        for w in (req.prefill, req.decode):
            if w in self.workers:
                self.workers[w].in_flight -= 1

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

    def _pick_pair(self, req: Request) -> tuple[str, str] | None:
        """Least-loaded prefill by queued tokens, decode by projected free pages, among those that fit the request."""
        n, m = req.prompt_len, req.params.max_tokens
        prefills = [w for w in self._rotation("prefill") if n <= w.hello.pool_tokens or not self.safety.admission]
        decodes = [w for w in self._rotation("decode") if n + m <= w.hello.pool_tokens or not self.safety.admission]
        if not prefills or not decodes:
            return None
        prefill = min(prefills, key=lambda w: (w.hello.queued_tokens + w.in_flight * n, w.hello.worker))
        decode = min(decodes, key=lambda w: (-w.projected_free_pages(), w.in_flight, w.hello.worker))
        return prefill.hello.worker, decode.hello.worker

    def _rotation(self, role: str) -> list[WorkerInfo]:
        """The live workers of ``role`` that are not drained."""
        return [w for w in self.workers.values() if w.hello.role == role and w.hello.worker not in self.drained]

    def _no_pair_error(self) -> ServiceUnavailable:
        for role in ("prefill", "decode"):
            if self._role(role) and not self._rotation(role):
                return ServiceUnavailable(f"Every {role} worker is drained; try again later.")
        return ServiceUnavailable("No prefill/decode worker pair is available; try again shortly.")
