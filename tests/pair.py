"""A real prefill worker and a real decode worker in this process, with the router's core between them.

Everything is production code: the workers' protocol cores and executors, engines, KV pools, page tags and
the shm data plane, and the router's core and executor. Only the control messages are carried by hand
(``pump``) instead of over ZeroMQ, so a test can order, hold and inspect them exactly, and hold data-plane
writes in flight (``hold_writes``) to make a write land late.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future

from kvfence.config import EngineConfig
from kvfence.core import KvfenceError, Request, SamplingParams
from kvfence.protocol.actions import Deliver
from kvfence.protocol.capacity import DispatchLimits
from kvfence.protocol.executor import RouterExecutor
from kvfence.protocol.messages import Message, Output
from kvfence.protocol.router import RouterCore
from kvfence.safety import Safety
from kvfence.workers.common import WorkerSettings
from kvfence.workers.decode import DecodeWorker
from kvfence.workers.prefill import PrefillWorker
from tests.server import free_port

ROUTER = "router"


class Result:
    """What one client received: tokens, or an error."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: KvfenceError | None = None
        self.gone = False  # the client left: it waits for nothing more
        self.preemptions = 0  # from the last output: times decode preempted it

    @property
    def ended(self) -> bool:
        return self.gone or self.error is not None or self.finish_reason is not None

    @property
    def status(self) -> int | None:
        return self.error.status if self.error is not None else (200 if self.finish_reason else None)


class Wire:
    """One node's network in the pair: what it sends waits in ``Pair.inflight`` until ``pump`` carries it."""

    def __init__(self, inflight: deque[tuple[str, str, Message]], me: str) -> None:
        self.inflight, self.me, self.epoch = inflight, me, 0

    def send(self, to: str, msg: Message) -> None:
        self.inflight.append((self.me, to, msg))


class Pair:
    def __init__(self, model: str, *, max_context: int, prefill_pool: int, decode_pool: int, page_size: int = 16,
                 emulate_incident: bool = False, dtype: str = "float32", step_tokens: int = 512,
                 handoff_timeout: float = 30.0, limits: DispatchLimits | None = None,
                 decode_solo_threads: int = 0) -> None:
        def settings(role: str, pool: int) -> WorkerSettings:
            engine = EngineConfig(max_context=max_context, kv_pool_tokens=pool, page_size=page_size, chunk_size=64,
                                  step_tokens=step_tokens, prefix_caching=True, role=role)
            return WorkerSettings(bind=f"tcp://127.0.0.1:{free_port()}", router=ROUTER, model=model, dtype=dtype,
                                  device="cpu", engine=engine, emulate_incident=emulate_incident,
                                  handoff_timeout=handoff_timeout,
                                  solo_threads=decode_solo_threads if role == "decode" else 0)

        self.prefill = PrefillWorker(settings("prefill", prefill_pool))
        self.decode = DecodeWorker(settings("decode", decode_pool))
        self.router = RouterCore(ROUTER, max_context, Safety.from_env(), limits=limits)
        self.inflight: deque[tuple[str, str, Message]] = deque()  # (sender, to, msg)
        self.executor = RouterExecutor(self.router, self, Wire(self.inflight, ROUTER), time.monotonic)
        self.workers = {w.me: w for w in (self.prefill, self.decode)}
        for worker in self.workers.values():
            worker.executor.net = Wire(self.inflight, worker.me)
        self.results: dict[int, Result] = {}
        self.held: list[tuple[Future, object, list]] = []
        self.holding = False
        for worker in (self.decode, self.prefill):
            self.executor.run(self.router.worker_up(worker.hello()))
        self.pump()

    # -- clients ---------------------------------------------------------------------

    def submit(self, prompt: list[int], max_tokens: int = 8, tenant: str = "default") -> int:
        req = Request(prompt, SamplingParams(max_tokens, temperature=0.0, ignore_eos=True), tenant)
        self.results[req.rid] = Result()
        self.executor.run(self.router.submit(req))
        return req.rid

    def client_gone(self, rid: int) -> None:
        self.results[rid].gone = True
        self.executor.run(self.router.client_gone(rid))

    # -- moving things ---------------------------------------------------------------

    def pump(self, *, only: type | None = None) -> None:
        """Deliver queued control messages (only those of type ``only`` if given) until none is left."""
        while True:
            picked = next((m for m in self.inflight if only is None or isinstance(m[2], only)), None)
            if picked is None:
                return
            self.inflight.remove(picked)
            sender, to, msg = picked
            if to == ROUTER:
                self.executor.receive(sender, msg)
            else:
                self.workers[to].executor.receive(sender, msg)

    def run(self, rids: list[int] | None = None, timeout: float = 60) -> None:
        """Pump messages and step both workers until ``rids`` (default: every request) have ended."""
        deadline = time.monotonic() + timeout
        while not all(self.results[r].ended for r in (rids or self.results)):
            assert time.monotonic() < deadline, "requests did not end"
            self.step()

    def step_until(self, done, rounds: int = 30) -> bool:
        """Step until ``done()`` holds (True) or ``rounds`` steps have passed (False)."""
        for _ in range(rounds):
            if done():
                return True
            self.step()
            time.sleep(0.01)  # writes to a peer land on the initiator's thread
        return done()

    def settle(self, rounds: int = 50) -> None:
        """Step until no message is in flight and no worker has work (bounded)."""
        for _ in range(rounds):
            if not self.inflight and not self.prefill.has_work() and not self.decode.has_work():
                return
            self.step()
        raise AssertionError("the pair did not settle")

    def step(self) -> None:
        """One round: deliver messages, then one step (and tick) of each worker."""
        self.pump()
        for worker in (self.prefill, self.decode):
            if worker.has_work():
                worker.step()
            worker.executor.tick()
        self.pump()

    # -- the data plane ----------------------------------------------------------------

    def hold_writes(self) -> None:
        """From now until ``stop_holding``, prefill's writes stay in flight (not landed) until ``release_writes``."""
        initiator = self.prefill.initiator
        real_submit = initiator.submit
        self.holding = True

        def held_submit(peer, segments, timeout=None) -> Future:
            if not self.holding:
                return real_submit(peer, segments, timeout)
            future: Future = Future()
            self.held.append((future, peer, list(segments)))
            return future

        initiator.submit = held_submit

    def stop_holding(self) -> None:
        """Writes submitted from now on land as usual; those already held stay held."""
        self.holding = False

    def release_writes(self) -> None:
        """Let every held write land now, in order."""
        held, self.held = self.held, []
        for future, peer, segments in held:
            self.prefill.initiator.write(peer, segments)
            future.set_result(None)

    # -- the clients (the router executor's) ---------------------------------------------

    def deliver(self, action: Deliver) -> None:
        result = self.results.get(action.rid)
        assert result is not None and not result.ended, "a request ended twice, or after its client left"
        if action.error is not None:
            result.error = action.error
        elif isinstance(action.output, Output):
            result.tokens += action.output.token_ids
            result.finish_reason = action.output.finish_reason
            result.preemptions = action.output.preemptions
