"""Carrying out what the protocol cores decide: one executor for the workers, the router and the model checker.

A core decides and returns actions; an executor feeds it its inputs (messages, timer ticks, what the runner or
engine reports), with the time from its clock, and carries out the actions that come back against an
environment: the network, the prefill runner (compute and KV writes), the decode engine, the clients.
Production plugs in ZeroMQ, the engines and the HTTP handlers (``workers/``, ``router/remote.py``);
``kvfence verify`` plugs in its modelled network, data plane and engine (``verify/world.py``), so the glue the
checker explores is the glue that runs.

Contracts:
- Actions run in order, breadth first: follow-ups (a runner that could not start, an engine's first
  outputs) run after the whole batch that caused them.
- Every message a core sends goes through ``Network.send``, and nothing else does.
- ``Fenced`` under a newer epoch makes a worker drop every request it holds (``drop_all``), speak under that
  epoch from then on, and say Hello again; one under an epoch already left is ignored.
- Prefill learns where decode pools are only from ``Peers``; a ``WorkerDown`` forgets that decode worker
  before its core hears of the death, so no later start can reach the dead pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvfence.core import KvfenceError, ServiceUnavailable, TokenLogprob
from kvfence.protocol.actions import Action, Deliver, Send, StartDecode, StartPrefill, StopDecode, StopPrefill
from kvfence.protocol.decode import DecodeCore
from kvfence.protocol.messages import Fenced, Hello, Message, Output, Peers, Reject, WorkerDown
from kvfence.protocol.prefill import PrefillCore
from kvfence.protocol.router import RouterCore

Clock = Callable[[], float]


class Network(Protocol):
    """Where a process's messages go (a ZeroMQ ``Channel``, or the checker's modelled channels)."""

    def send(self, to: str, msg: Message) -> None: ...


class WorkerNetwork(Network, Protocol):
    epoch: int  # the membership epoch this worker speaks under (``Fenced``), stamped on what it sends


class WorkerEnv(Protocol):
    def hello(self) -> Hello:
        """This worker's Hello as of now."""
        ...


@dataclass(frozen=True)
class Computed:
    """The runner's report for a request whose writes have all drained (or that failed: ``error``)."""

    rid: int
    tokens: int = 0  # prompt tokens written
    checksum: int = 0  # ``transfer_checksum`` of the pages written
    firsts: Sequence[tuple[int, TokenLogprob | None]] = ((0, None),)  # each choice's first token
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    error: KvfenceError | None = None


class PrefillEnv(WorkerEnv, Protocol):
    """Prefill's runner: computes prompts and writes their KV into decode pools."""

    peers: Peers  # the decode workers and their data-plane descriptors, as last heard

    def start(self, start: StartPrefill) -> None:
        """Begin computing and writing; raise if it cannot begin (then no write was issued)."""
        ...

    def stop(self, rid: int) -> None:
        """Stop computing ``rid`` between chunks; it still ends through ``finished``."""
        ...

    def finished(self) -> list[Computed]:
        """Requests whose writes have all drained since the last call."""
        ...


class DecodeEnv(WorkerEnv, Protocol):
    """Decode's engine."""

    def start(self, start: StartDecode) -> list[Output | Reject]:
        """Take over the landed pages; returns the first outputs."""
        ...

    def stop(self, rid: int) -> None:
        """Drop ``rid``; its pages are freed."""
        ...


class Clients(Protocol):
    def deliver(self, d: Deliver) -> None:
        """Hand ``d`` to its client, if it is still there."""
        ...


class Executor:
    """Runs actions: sends here, the rest in each role's ``carry_out``."""

    def __init__(self, net: Network, clock: Clock) -> None:
        self.net, self.clock = net, clock

    def run(self, actions: list[Action]) -> None:
        while actions:
            follow: list[Action] = []
            for action in actions:
                follow += self.carry_out(action)
            actions = follow

    def carry_out(self, action: Action) -> list[Action]:
        """Carry out one action; returns its follow-ups."""
        if isinstance(action, Send):
            self.net.send(action.to, action.msg)
            return []
        raise TypeError(f"{type(self).__name__} cannot carry out {action!r}")


class RouterExecutor(Executor):
    def __init__(self, core: RouterCore, clients: Clients, net: Network, clock: Clock) -> None:
        super().__init__(net, clock)
        self.core, self.clients = core, clients

    def receive(self, sender: str, msg: Message, epoch: int = 0) -> None:
        """A message from ``sender`` under its membership ``epoch``."""
        self.run(self.core.handle(sender, msg, epoch))

    def tick(self) -> None:
        """Silence timeouts, the absent-role grace, dispatch."""
        self.run(self.core.tick(self.clock()))

    def carry_out(self, action: Action) -> list[Action]:
        if isinstance(action, Deliver):
            self.clients.deliver(action)
            return []
        return super().carry_out(action)


class PrefillExecutor(Executor):
    net: WorkerNetwork

    def __init__(self, core: PrefillCore, env: PrefillEnv, net: WorkerNetwork, clock: Clock) -> None:
        super().__init__(net, clock)
        self.core, self.env = core, env

    def receive(self, sender: str, msg: Message) -> None:
        """A message from ``sender``."""
        if isinstance(msg, Fenced):
            if rejoins(self.net, msg):
                self.run(self.core.drop_all())
                say_hello(self.net, msg, self.core.router, self.env)
        elif isinstance(msg, Peers):
            self.env.peers = msg
        elif isinstance(msg, WorkerDown):
            self.env.peers = Peers({w: d for w, d in self.env.peers.decodes.items() if w != msg.worker})
            self.run(self.core.peer_down(msg.worker))
        else:
            self.run(self.core.handle(sender, msg, self.clock()))

    def tick(self) -> None:
        """Timers, then whatever the runner has finished."""
        self.run(self.core.tick(self.clock()))
        self.collect()

    def progress(self, rid: int, tokens: int) -> None:
        """The runner computed ``tokens`` of ``rid``'s prompt so far."""
        self.run(self.core.progress(rid, tokens))

    def collect(self) -> None:
        """Report every request the runner has finished."""
        self.run(self._reports(self.env.finished()))

    def report(self, computed: Computed) -> None:
        """The runner finished one request."""
        self.run(self._reports([computed]))

    def carry_out(self, action: Action) -> list[Action]:
        if isinstance(action, StartPrefill):
            return self._start(action)
        if isinstance(action, StopPrefill):
            self.env.stop(action.rid)
            return self._reports(self.env.finished())
        return super().carry_out(action)

    def _start(self, start: StartPrefill) -> list[Action]:
        if start.decode not in self.env.peers.decodes:
            return self.core.compute_failed(start.rid, ServiceUnavailable("decode worker unreachable: unknown"))
        try:
            self.env.start(start)
        except KvfenceError as err:
            return self.core.compute_failed(start.rid, err)
        except Exception as exc:  # its data plane unreachable
            return self.core.compute_failed(start.rid, ServiceUnavailable(f"decode worker unreachable: {exc}"))
        return []

    def _reports(self, computed: list[Computed]) -> list[Action]:
        actions: list[Action] = []
        for c in computed:
            if c.error is not None:
                actions += self.core.compute_failed(c.rid, c.error)
                continue
            (first, logprob), *more = c.firsts
            actions += self.core.computed(c.rid, c.tokens, c.checksum, first, logprob, c.prompt_logprobs, more,
                                          c.cached_tokens)
        return actions


class DecodeExecutor(Executor):
    net: WorkerNetwork

    def __init__(self, core: DecodeCore, env: DecodeEnv, net: WorkerNetwork, clock: Clock) -> None:
        super().__init__(net, clock)
        self.core, self.env = core, env

    def receive(self, sender: str, msg: Message) -> None:
        """A message from ``sender``."""
        if isinstance(msg, Fenced):
            if rejoins(self.net, msg):
                self.run(self.core.drop_all(self.clock()))
                say_hello(self.net, msg, self.core.router, self.env)
        elif isinstance(msg, WorkerDown):
            self.run(self.core.peer_down(msg.worker, self.clock(), msg.fenced))
        else:
            self.run(self.core.handle(sender, msg, self.clock()))

    def tick(self) -> None:
        """Timers: waits for pages, handoffs, aborts."""
        self.run(self.core.tick(self.clock()))

    def outputs(self, outs: list[Output | Reject]) -> None:
        """The engine produced tokens, or ended requests."""
        self.run(self._engine_output(outs))

    def carry_out(self, action: Action) -> list[Action]:
        if isinstance(action, StartDecode):
            return self._engine_output(self.env.start(action))
        if isinstance(action, StopDecode):
            self.env.stop(action.rid)
            return []
        return super().carry_out(action)

    def _engine_output(self, outs: list[Output | Reject]) -> list[Action]:
        now = self.clock()
        return [a for out in outs for a in self.core.engine_output(out, now)]


def rejoins(net: WorkerNetwork, fenced: Fenced) -> bool:
    """Whether ``fenced`` moves this worker's epoch on (a repeat for an epoch already left does not)."""
    return fenced.epoch > net.epoch


def say_hello(net: WorkerNetwork, fenced: Fenced, router: str, env: WorkerEnv) -> None:
    """Speak under the new epoch from now on, starting with a Hello (the heartbeat would, a little later)."""
    net.epoch = fenced.epoch
    net.send(router, env.hello())
