"""The world the model checker explores: the real protocol cores inside an adversarial environment.

One ``World`` is one global state: a ``RouterCore``, a ``PrefillCore`` and a
``DecodeCore`` (with its ``PageTable``) exactly as production builds them,
and the environment around them: the control network, an abstract KV data
plane (``plane.py``), the prefill runner, the decode engine, the clients and
a clock. ``events()`` lists what may happen next; ``apply()`` makes one of
them happen through the production executors (``protocol/executor.py``, as
the workers and the router run them), which this module plugs into its
modelled network, runner, engine and clients.

What is modelled, and how (docs/protocol.md has the full list):

- **Network.** Every control message travels through ``net``, one queue per
  (sender, receiver) channel. With ``network="fifo"`` (ZeroMQ's guarantee)
  only a channel's head can be delivered; with ``"any"`` every message can
  overtake every other. The environment may drop or duplicate any message
  (bounded), and delays are free: nothing forces a delivery.
- **Time.** Abstract. ``tick`` jumps to the next deadline any core holds
  (the router's silence timeouts included; it ticks just before time passes);
  each worker, and the router, then handles its expired timers as its own
  event. With ``timing="bounded"`` time only passes while no message is in flight
  (every message arrives within the shortest timeout, or is lost); with
  ``"async"`` timeouts may fire while messages are still on their way.
- **Data plane.** A decode page holds a ``Label``: who wrote it last (its
  tag record: rid, epoch, page, tokens) and whether its bytes were corrupted.
  ``StartPrefill`` creates one pending ``Write`` per page; the environment
  lands them one at a time, in any order relative to everything else, and
  may fail, lose, shorten or corrupt one (bounded). The prefill core hears
  ``computed``/``compute_failed`` only once its runner has nothing pending.
  The pool starts out holding a ghost request's KV: pages are never scrubbed.
  Decode checks each landing with the real ``check_landing`` over the labels.
- **Workers.** Either may crash at any step (bounded). A crash loses its
  inbox, its core, its runner or engine; a crashed prefill's writes may
  still land until the router notices the death. The router notices
  (``worker_down``) before the supervisor restarts the worker, which comes
  back with a fresh core and says Hello.
- **Clients.** Submit in any order, may disconnect at any step (bounded),
  and record every token and error they receive.
- **Fencing.** The router may declare a live worker dead (``fence``: it was
  paused past the worker timeout) and fence it. The worker runs on: its
  writes may land, and what it sends travels under the epoch it holds. Once
  unregistered it sends a heartbeat (``heartbeat``); a ``Fenced`` answer makes
  it drop what it held (``drop_all``) and say Hello under the new epoch.
  Checked: nothing sent under a fenced epoch reaches a client (I7), pages
  wait for the fenced writer (I2), and everything ends (I4, I5).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, NamedTuple

import msgspec
import numpy as np

from kvfence.core import IntegrityError, Request, SamplingParams, ServiceUnavailable
from kvfence.descriptors import ShmDescriptor
from kvfence.kvcache.layout import tokens_per_page, transfer_checksum
from kvfence.kvcache.pages import PageGrant, PageState, PageTable
from kvfence.protocol.actions import Deliver, Send, StartDecode, StartPrefill
from kvfence.protocol.capacity import UNGATED, DispatchLimits, FairQueue, FairShares, QueuePolicy
from kvfence.protocol.decode import DecodeCore, DecodeLimits, DState
from kvfence.protocol.executor import Computed, DecodeExecutor, PrefillExecutor, RouterExecutor
from kvfence.protocol.messages import (
    DecodeSide,
    Envelope,
    ErrorInfo,
    Hello,
    Message,
    Output,
    Peers,
    PrefillSide,
    Reject,
)
from kvfence.protocol.prefill import PrefillCore, PrefillLimits, PState
from kvfence.protocol.router import RouterCore, retry_rid
from kvfence.safety import Safety
from kvfence.verify.plane import ZEROS, Label, Write, landing_problem, page_sum

ROUTER, PREFILL, DECODE = "router", "prefill-0", "decode-0"
GHOST_RID, GHOST_TENANT = 99, "carol"  # whoever used the pool before the checked run began
TIMED = frozenset({PState.WAIT_DEST, PState.WAIT_PREFILL, DState.WAITING, DState.AWAIT_DONE, DState.ABORTING})

# Events that the environment may choose never to do: a state whose only events are faults is stuck.
FAULTS = frozenset({"drop", "dup", "crash", "disconnect", "fail", "lose", "short", "corrupt", "fence"})


# -- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    name: str  # A, B, C: how traces name it
    tenant: str
    prompt_len: int
    max_tokens: int
    rid: int


@dataclass(frozen=True)
class Faults:
    """How many times the environment may do each bad thing in one run."""

    drop: int = 0  # lose a control message (between live processes ZeroMQ does not)
    dup: int = 1  # deliver a control message twice
    crash: int = 1  # kill a worker (it is then noticed and restarted)
    disconnect: int = 1  # a client leaves before its request ends
    fail: int = 1  # a data-plane write fails (the runner sees the error)
    lose: int = 1  # a data-plane write reports success but never lands
    short: int = 1  # the prefill runner writes (and reports) one token fewer than the prompt
    corrupt: int = 1  # a data-plane write lands with flipped bytes
    fence: int = 0  # the router declares a live worker dead (paused past the timeout) and fences it
    total: int = 1  # faults of any kind in one run, at most

    def budget(self) -> tuple[int, ...]:
        return tuple(getattr(self, f) for f in FAULT_ORDER)


FAULT_ORDER = ("drop", "dup", "crash", "disconnect", "fail", "lose", "short", "corrupt", "fence")


def default_requests() -> tuple[RequestSpec, ...]:
    """Two tenants; C (over the context limit) arrives first, then A and B, which each need 2 of the 3 pages."""
    return (RequestSpec("C", "bob", 5, 2, 3), RequestSpec("A", "alice", 4, 2, 1), RequestSpec("B", "bob", 4, 2, 2))


@dataclass(frozen=True)
class CheckConfig:
    requests: tuple[RequestSpec, ...] = field(default_factory=default_requests)
    pages: int = 3  # decode pool pages
    page_size: int = 2
    max_context: int = 6  # router, prefill and decode
    prefill_pool_tokens: int = 6
    prefill_max_context: int = 0  # 0: max_context; less: a prefill started with a smaller context than the rest
    faults: Faults = field(default_factory=Faults)
    network: str = "fifo"  # "fifo" (per channel, as ZeroMQ) | "any"
    timing: str = "bounded"  # "bounded" | "async"
    arrival: str = "ordered"  # "ordered": clients submit in config order | "any"
    crash_roles: tuple[str, ...] = (PREFILL, DECODE)
    # a crashed worker may come back before the router notices it died (a remote worker restarted within the
    # heartbeat timeout): the router then never calls worker_down for it
    quick_restart: bool = False
    safety: Safety = field(default_factory=Safety)
    emulate_incident: bool = False
    # the router holds a request in its queue until its pair has room (production's DispatchLimits); off, it sends
    # every request at once, so decode's own wait for pages (the default requests' B behind A) stays explored
    router_gate: bool = False
    # the protocol's own timeouts (seconds, as in production: waits for pages and for a Dest are 4x the handoff's)
    dest_timeout: int = 120
    orphan_dest_timeout: int = 5
    handoff_timeout: int = 30
    abort_timeout: int = 10
    page_wait_timeout: int = 120
    _specs: dict[int, RequestSpec] = field(init=False, repr=False, compare=False)  # rid -> its request (spec)

    def __post_init__(self) -> None:
        if self.network not in ("fifo", "any"):
            raise ValueError("network must be 'fifo' or 'any'")
        if self.timing not in ("bounded", "async"):
            raise ValueError("timing must be 'bounded' or 'async'")
        if self.arrival not in ("ordered", "any"):
            raise ValueError("arrival must be 'ordered' or 'any'")
        rids = [r.rid for r in self.requests]
        if len(set(rids)) != len(rids) or GHOST_RID in rids or 0 in rids:
            raise ValueError("request ids must be distinct, non-zero and not the ghost's")
        specs = {rid: r for r in self.requests for rid in (r.rid, retry_rid(r.rid))}
        object.__setattr__(self, "_specs", specs)

    def spec(self, rid: int) -> RequestSpec:
        """The request ``rid`` names: a client's id, or its retry's (``retry_rid``)."""
        return self._specs[rid]

    def over_length(self, spec: RequestSpec) -> bool:
        """Over some role's limit: the client's fault, so it must never get tokens."""
        return self.router_sees_over_length(spec) or spec.prompt_len + spec.max_tokens > self.prefill_context

    def router_sees_over_length(self, spec: RequestSpec) -> bool:
        """Over a limit the router knows (its context, the pools the Hellos announce): it must get exactly 400."""
        n, m = spec.prompt_len, spec.max_tokens
        return n + m > self.max_context or n + m > self.pages * self.page_size or n > self.prefill_pool_tokens

    @property
    def prefill_context(self) -> int:
        return self.prefill_max_context or self.max_context

    def describe(self) -> str:
        reqs = ", ".join(f"{r.name}={r.tenant}:{r.prompt_len}+{r.max_tokens}" + (" (over-length)"
                         if self.over_length(r) else "") for r in self.requests)
        faults = ", ".join(f"{f} {n}" for f, n in zip(FAULT_ORDER, self.faults.budget(), strict=True) if n)
        off = ",".join(self.safety.disabled) or "none"
        return (f"requests {reqs}; decode pool {self.pages} pages x {self.page_size} tokens; context "
                f"{self.max_context}" + (f" (prefill {self.prefill_context})" if self.prefill_max_context else "")
                + f"; arrival {self.arrival}; network {self.network}; timing {self.timing}; "
                f"faults: {faults or 'none'} (at most {self.faults.total} per run); "
                f"layers off: {off}" + ("; incident emulation" if self.emulate_incident else ""))


# -- the abstract data plane, runner and engine ------------------------------------------------


@dataclass
class Run:
    """The prefill runner's shipment of one request: writes still pending, and how it will end."""

    rid: int
    tokens: int  # what it reports in Done
    pending: tuple[Write, ...]
    last_page: int  # where the prompt's last tokens go
    sums: tuple[int, ...]  # each page's checksum, as its tag records it; Done reports their transfer checksum
    stopped: bool = False
    failed: bool = False
    short: bool = False


@dataclass
class Seq:
    """A request the decode engine is decoding."""

    rid: int
    grants: tuple[PageGrant, ...]
    prompt_len: int
    max_tokens: int
    produced: int = 0


@dataclass
class PrefillNode:
    core: PrefillCore | None
    peers: Peers  # the decode workers' descriptors (each names its incarnation), as the router last sent them
    runs: dict[int, Run] = field(default_factory=dict)
    inc: int = 0
    down: bool = False
    noticed: bool = True  # the router has handled this worker's death
    epoch: int = 0  # the membership epoch it holds, stamped on what it sends the router

    @property
    def live(self) -> PrefillCore:
        """The core of this node, which is up (a crashed node has none until it restarts)."""
        assert self.core is not None, "prefill is down"
        return self.core


@dataclass
class DecodeNode:
    core: DecodeCore | None
    plane: tuple[Label, ...]
    engine: dict[int, Seq] = field(default_factory=dict)
    inc: int = 0
    down: bool = False
    noticed: bool = True
    epoch: int = 0

    @property
    def live(self) -> DecodeCore:
        """The core of this node, which is up (a crashed node has none until it restarts)."""
        assert self.core is not None, "decode is down"
        return self.core


class PlaneVerifier:
    """DecodeCore's ``verify``: the real ``check_landing`` over the modelled pool (``plane.landing_problem``)."""

    def __init__(self, node: DecodeNode, safety: Safety, page_size: int) -> None:
        self.node = weakref.ref(node)  # the node holds the core that holds this: no cycle (explore pauses the gc)
        self.safety, self.page_size = safety, page_size

    def __call__(self, rid: int, grants: list[PageGrant], expected_tokens: int, checksum: int) -> str | None:
        node = self.node()
        assert node is not None, "a decode core ran outside the world that owns it"
        return landing_problem(node.plane, self.page_size, self.safety, rid, grants, expected_tokens, checksum)


# -- the environment the executors act on (built per event: a world's parts are copied on write) -------------


class _Net:
    """A process's modelled network: what it sends goes into the world's channels, stamped with its epoch."""

    def __init__(self, world: World, me: str) -> None:
        self.world, self.me = world, me

    @property
    def epoch(self) -> int:
        return 0 if self.me == ROUTER else self.world._node(self.me).epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.world._node(self.me).epoch = epoch

    def send(self, to: str, msg: Message) -> None:
        self.world._send(self.me, to, msg)


class _Runner:
    """Prefill's modelled runner: writes per page, which the environment lands (``finish`` reports them)."""

    def __init__(self, world: World) -> None:
        self.world = world

    @property
    def peers(self) -> Peers:
        return self.world.prefill.peers

    @peers.setter
    def peers(self, peers: Peers) -> None:
        self.world.prefill.peers = peers

    def start(self, start: StartPrefill) -> None:
        self.world._start_prefill(start)

    def stop(self, rid: int) -> None:
        self.world._stop_prefill(rid)

    def finished(self) -> list[Computed]:
        return []  # a run ends as an event of its own (``finish``), once nothing of it is pending

    def hello(self) -> Hello:
        return self.world._hello(PREFILL)


class _Engine:
    """Decode's modelled engine."""

    def __init__(self, world: World) -> None:
        self.world = world

    def start(self, start: StartDecode) -> list[Output | Reject]:
        return self.world._start_decode(start)

    def stop(self, rid: int) -> None:
        self.world._stop_decode(rid)

    def hello(self) -> Hello:
        return self.world._hello(DECODE)


class _Clients:
    def __init__(self, world: World) -> None:
        self.world = world

    def deliver(self, d: Deliver) -> None:
        self.world._deliver_to_client(d)


# -- clients ------------------------------------------------------------------------------------


class Client(NamedTuple):
    submitted: bool = False
    gone: bool = False
    tokens: tuple[int, ...] = ()
    status: int | None = None  # set when it ends: 200, or the error's status
    code: str | None = None
    rejected_by: str | None = None  # the first worker whose Reject reached the router while this client waited
    rejected_status: int | None = None  # ... and the status it gave

    @property
    def ended(self) -> bool:
        return self.status is not None


@dataclass(frozen=True)
class Violation:
    invariant: str  # "I1".."I6", or "E" (a core raised)
    message: str


# -- the world ----------------------------------------------------------------------------------

Event = tuple  # ("deliver", (sender, receiver), index), ("land", "run", Write), ("tick",), ...

# Which core each kind of event may change (the rest change no core); see World.apply.
_TOUCHES_ROUTER = frozenset({"submit", "disconnect", "notice", "fence"})
_TOUCHES_WORKER = frozenset({"timeout", "crash", "restart"})


def _target(inc: int) -> ShmDescriptor:
    """The modelled decode's KV target in incarnation ``inc``: a region its process (pid 200 + inc) owns, so a
    restarted decode names another one."""
    return ShmDescriptor(nbytes=0, path=DECODE, pid=200 + inc)


def _incarnation(side: DecodeSide) -> int:
    """The decode incarnation whose target ``side`` names (``_target``'s inverse)."""
    assert isinstance(side.target, ShmDescriptor)  # the model's targets are ``_target``'s
    return side.target.pid - 200


def _writes_to(ev: Event) -> tuple[str, ...]:
    """The parts of a world that an event may change, besides net, clients and budgets (copied always)."""
    kind = ev[0]
    if kind in ("submit", "disconnect"):
        return (ROUTER,)
    if kind in ("notice", "fence"):
        return (ROUTER, ev[1])
    if kind == "deliver":
        return (ev[1][1],)
    if kind in ("land", "cancel", "fail", "lose", "corrupt"):
        return (PREFILL, "plane") if ev[1] == "run" else ("plane",)
    if kind in ("short", "finish"):
        return (PREFILL,)
    if kind == "step":
        return (DECODE,)
    if kind in ("timeout", "crash", "restart", "heartbeat"):
        return (ev[1],)
    if kind == "tick":
        return (ROUTER,)  # its last tick before time passes
    return ()


class World:
    def __init__(self, cfg: CheckConfig) -> None:
        self.cfg = cfg
        self.now: float = 0  # abstract time (whole seconds: every timeout is one), as the cores' clocks
        # first come, first served: the fair order's token counters would tell apart states that behave alike
        self.router = RouterCore(ROUTER, cfg.max_context, cfg.safety, policy=QueuePolicy(scheduling="fcfs"),
                                 limits=DispatchLimits() if cfg.router_gate else UNGATED)
        self.prefill = PrefillNode(self._new_prefill_core(), Peers({}))
        self.decode = DecodeNode(None, ())
        self._boot_decode(ghost=True)
        self.net: dict[tuple[str, str], tuple[Message | Envelope, ...]] = {}
        self.wire: dict[tuple[str, str], tuple[bytes, ...]] = {}  # the same messages, encoded (for key())
        self.zombies: tuple[Write, ...] = ()  # writes of a crashed prefill the router has not noticed yet
        self.clients = {r.rid: Client() for r in cfg.requests}
        self.budget = list(cfg.faults.budget())
        self.faults_used = 0
        self._core_keys: dict[str, object] = {}  # canonical form of each core, until an event touches it
        self._owned = {ROUTER, PREFILL, DECODE, "plane"}  # parts not shared with the world this was cloned from
        self.changed = {ROUTER, PREFILL, DECODE}  # cores whose canonical form key() had to recompute
        self.violations: list[Violation] = []
        self.log: list[str] | None = None  # set to a list to record what each event did
        for hello in (self._hello(PREFILL), self._hello(DECODE)):
            for action in self.router.worker_up(hello):  # Peers to the prefill, as on a real start
                assert isinstance(action, Send) and isinstance(action.msg, Peers)
                self.prefill.peers = action.msg

    # -- building -------------------------------------------------------------------------

    def _new_prefill_core(self) -> PrefillCore:
        c = self.cfg
        limits = PrefillLimits(c.prefill_context, c.prefill_pool_tokens, c.page_size, c.dest_timeout,
                               c.orphan_dest_timeout)
        return PrefillCore(PREFILL, ROUTER, limits, c.safety, c.emulate_incident)

    def _boot_decode(self, ghost: bool) -> None:
        c, node = self.cfg, self.decode
        limits = DecodeLimits(c.max_context, c.page_size, c.handoff_timeout, c.abort_timeout, c.page_wait_timeout)
        node.core = DecodeCore(DECODE, ROUTER, PageTable(c.pages), limits, c.safety,
                               PlaneVerifier(node, c.safety, c.page_size))
        node.plane = tuple(Label(GHOST_RID, 0, p, c.page_size) if ghost else ZEROS for p in range(c.pages))
        node.engine = {}

    def _hello(self, worker: str) -> Hello:
        c = self.cfg
        if worker == PREFILL:
            return Hello(PREFILL, PREFILL, PrefillSide(self.prefill.peers.digest()), c.prefill_pool_tokens,
                         c.prefill_context,
                         pid=100 + self.prefill.inc)
        return Hello(DECODE, DECODE, DecodeSide(_target(self.decode.inc), c.pages), c.pages * c.page_size,
                     c.max_context, free_pages=c.pages, pid=200 + self.decode.inc)

    def clone(self) -> World:
        """A copy that shares the cores until an event needs to change one (copy on write)."""
        new = World.__new__(World)
        new.__dict__.update(self.__dict__)
        new.net = dict(self.net)
        new.wire = dict(self.wire)
        new.clients = dict(self.clients)
        new.budget = list(self.budget)
        new._core_keys = dict(self._core_keys)
        new._owned = set()
        new.changed = set()
        new.violations = []
        new.log = None
        return new

    def _own(self, part: str) -> None:
        """Copy ``part`` before this world changes it, unless it already has its own copy."""
        if part in self._owned:
            return
        self._owned.add(part)
        if part == ROUTER:
            self.router = _copy_router(self.router)
        elif part == PREFILL:
            self.prefill = _copy_prefill(self.prefill)
        elif part == DECODE:
            self.decode = _copy_decode(self.decode)
            self._owned.add("plane")
        else:  # "plane": the decode node itself, not its core (whose verifier is rebound when it is copied)
            self.decode = _copy_obj(self.decode)

    def key(self) -> bytes:
        """The canonical hash of this state: equal for states that behave the same from here on.

        Absolute time is left out (every deadline counts from now), and so are a core's deadlines in
        states that never consult them. Messages in one channel keep their order under FIFO and are
        a multiset otherwise. A core's part is cached until an event touches that core.
        """
        fifo = self.cfg.network == "fifo"
        p, d = self.prefill, self.decode
        net = []
        for chan in sorted(self.wire):
            msgs = self.wire[chan]
            net.append((chan, msgs if fifo else tuple(sorted(msgs))))
        parts = (
            self._core_key(ROUTER),
            self._core_key(PREFILL),
            self._core_key(DECODE),
            (p.inc, p.down, p.noticed, p.epoch, p.peers.digest(),
             tuple(sorted((rid, r.tokens, tuple(map(_wkey, r.pending)), r.last_page, r.sums, r.stopped, r.failed,
                           r.short)
                          for rid, r in p.runs.items()))),
            (d.inc, d.down, d.noticed, d.epoch, tuple(map(_lkey, d.plane)),
             tuple(sorted((rid, tuple((g.page, g.epoch) for g in s.grants), s.produced)
                          for rid, s in d.engine.items()))),
            tuple(net),
            tuple(sorted(map(_wkey, self.zombies))),
            tuple(tuple(self.clients[r.rid]) for r in self.cfg.requests),
            tuple(self.budget),
        )
        return _digest(parts)

    def _core_key(self, who: str):
        k = self._core_keys.get(who)
        if k is None:
            self.changed.add(who)
            core = self.router if who == ROUTER else self._node(who).core
            k = self._core_keys[who] = _digest(canon(core, self.now))
        return k

    def fresh_key(self) -> bytes:
        """``key()`` with no cached part (tests compare the two)."""
        cached, self._core_keys = self._core_keys, {}
        try:
            return self.key()
        finally:
            self._core_keys = cached

    # -- what may happen next --------------------------------------------------------------

    def events(self) -> list[Event]:
        """Every event enabled here, progress first, then faults."""
        evs: list[Event] = []
        for spec in self.cfg.requests:
            if not self.clients[spec.rid].submitted:
                evs.append(("submit", spec.rid))
                if self.cfg.arrival == "ordered":
                    break
        for chan, i, _msg in self._deliverable():
            evs.append(("deliver", chan, i))
        for src, w in self._writes():
            evs.append(("land", src, w))
            if src == "run" and self.prefill.runs[w.rid].stopped:
                evs.append(("cancel", src, w))
        for rid, run in self.prefill.runs.items():
            if not run.pending:
                evs.append(("finish", rid))
        for rid in self.decode.engine:
            evs.append(("step", rid))
        for worker in (PREFILL, DECODE):
            node = self._node(worker)
            if not node.down and self._expired(node.live):
                evs.append(("timeout", worker))
            if node.down and not node.noticed:
                evs.append(("notice", worker))
            if node.down and (node.noticed or self.cfg.quick_restart):
                evs.append(("restart", worker))
            if self._heartbeat_due(worker):
                evs.append(("heartbeat", worker))
        if self._router_expired():
            evs.append(("timeout", ROUTER))
        if self._next_deadline() is not None:
            evs.append(("tick",))
        evs += self._fault_events()
        return evs

    def _fault_events(self) -> list[Event]:
        evs: list[Event] = []
        if self.faults_used >= self.cfg.faults.total:
            return evs
        left = dict(zip(FAULT_ORDER, self.budget, strict=True))
        if left["disconnect"]:
            for rid, client in self.clients.items():
                if client.submitted and not client.ended and not client.gone:
                    evs.append(("disconnect", rid))
        if left["drop"] or left["dup"]:
            for chan, i, _msg in self._deliverable():
                if left["drop"]:
                    evs.append(("drop", chan, i))
                if left["dup"]:
                    evs.append(("dup", chan, i))
        for src, w in self._writes():
            if w.target != self.decode.inc or self.decode.down:
                continue
            for fault in ("fail", "lose", "corrupt"):
                if left[fault] and not (fault == "fail" and src != "run") and not (fault == "corrupt" and w.corrupt):
                    evs.append((fault, src, w))
        if left["short"]:
            for rid, run in self.prefill.runs.items():
                if not run.short and run.tokens > 1 and any(w.page == run.last_page for w in run.pending):
                    evs.append(("short", rid))
        if left["crash"] and self.busy():
            for worker in self.cfg.crash_roles:
                if not self._node(worker).down:
                    evs.append(("crash", worker))
        if left["fence"] and self.busy():
            for worker in (PREFILL, DECODE):
                if worker in self.router.workers:
                    evs.append(("fence", worker))
        return evs

    def _heartbeat_due(self, worker: str) -> bool:
        """A heartbeat that changes something: the worker is live, unknown to the router (fenced, or its Hello was
        lost), or a prefill holding stale Peers (its Hello's digest makes the router send them again); and nothing
        is on its way between them (one at a time, so that heartbeats do not pile up)."""
        if self._node(worker).down or (worker, ROUTER) in self.net or (ROUTER, worker) in self.net:
            return False
        stale = worker == PREFILL and self.prefill.peers.digest() != self.router._peers().digest()
        return worker not in self.router.workers or stale

    def _deliverable(self) -> Iterator[tuple[tuple[str, str], int, Message | Envelope]]:
        for chan, queue in sorted(self.net.items()):
            dst = chan[1]
            if dst != ROUTER and self._node(dst).down:
                continue  # queued until it is back
            if self.cfg.network == "fifo":
                yield chan, 0, queue[0]
            else:
                seen = set()
                for i, (msg, wire) in enumerate(zip(queue, self.wire[chan], strict=True)):
                    if wire not in seen:  # equal copies are one choice
                        seen.add(wire)
                        yield chan, i, msg

    def _writes(self) -> Iterator[tuple[str, Write]]:
        if not self.prefill.down:
            for run in self.prefill.runs.values():
                for w in dict.fromkeys(run.pending):
                    yield "run", w
        for w in dict.fromkeys(self.zombies):
            yield "zombie", w

    def _expired(self, core: PrefillCore | DecodeCore) -> bool:
        return any(r.state in TIMED and self.now >= r.deadline for r in core.reqs.values())

    def _next_deadline(self) -> float | None:
        """When time may next jump to, or None if it may not pass now."""
        deadlines: list[float] = []
        for worker in (PREFILL, DECODE):
            node = self._node(worker)
            if node.down:
                continue
            core = node.live
            if self._expired(core):
                return None  # handle what has expired first
            deadlines += [r.deadline for r in core.reqs.values() if r.state in TIMED]
        if self._router_expired():
            return None
        deadlines += self._router_deadlines()
        if not deadlines:
            return None
        if self.cfg.timing == "bounded" and any(True for _ in self._deliverable()):
            return None
        return min(deadlines)

    def _router_deadlines(self) -> list[float]:
        """When each request's silence timeout can fire (the router ticks just before time passes, so a request
        heard since then counts from now). A request being decoded is not silent: it speaks at every step."""
        t = self.router.silence_timeout
        decoding = () if self.decode.down else self.decode.engine
        return [(self.now if r.heard or r.quiet_since is None else r.quiet_since) + t + 1
                for r in self.router.reqs.values() if r.rid not in decoding]

    def _router_expired(self) -> bool:
        t = self.router.silence_timeout
        return any(not r.heard and r.quiet_since is not None and self.now - r.quiet_since > t
                   for r in self.router.reqs.values())

    def busy(self) -> bool:
        """Some request has not ended everywhere yet."""
        return not self.quiescent()

    def quiescent(self) -> bool:
        """Every client has its ending (or left), every role has forgotten every request, nothing is in flight."""
        p, d = self.prefill, self.decode
        return (all(c.submitted and (c.ended or c.gone) for c in self.clients.values())
                and not self.router.reqs and not p.down and not d.down and not p.live.reqs and not p.runs
                and PREFILL in self.router.workers and DECODE in self.router.workers
                and not d.live.reqs and not d.live.waiting and not d.engine and not self.zombies and not self.net)

    # -- making it happen ---------------------------------------------------------------------

    def apply(self, ev: Event) -> None:
        kind = ev[0]
        for part in _writes_to(ev):
            self._own(part)
        if kind == "tick":
            self._core_keys = {}
        elif kind in _TOUCHES_ROUTER:
            self._core_keys.pop(ROUTER, None)
        elif kind == "deliver":
            self._core_keys.pop(ev[1][1], None)
        elif kind in _TOUCHES_WORKER:
            self._core_keys.pop(ev[1], None)
        elif kind == "finish":
            self._core_keys.pop(PREFILL, None)
        elif kind == "step":
            self._core_keys.pop(DECODE, None)
        getattr(self, "_ev_" + kind)(*ev[1:])
        if ev[0] in FAULTS:
            self.budget[FAULT_ORDER.index(ev[0])] -= 1
            self.faults_used += 1

    def _ev_submit(self, rid: int) -> None:
        spec = self.cfg.spec(rid)
        self.clients[rid] = self.clients[rid]._replace(submitted=True)
        over = " (over the limit)" if self.cfg.over_length(spec) else ""
        self._note(lambda: f"client {spec.name} (tenant {spec.tenant}) submits a {spec.prompt_len}-token prompt, "
                           f"max_tokens {spec.max_tokens}{over}")
        prompt = [10 * rid + i for i in range(spec.prompt_len)]
        req = Request(prompt, SamplingParams(spec.max_tokens), spec.tenant, rid=rid)
        self._router().run(self.router.submit(req, self.now))

    def _ev_disconnect(self, rid: int) -> None:
        self.clients[rid] = self.clients[rid]._replace(gone=True)
        self._note(lambda: f"client {self._name(rid)} disconnects")
        self._router().run(self.router.client_gone(rid))

    def _ev_deliver(self, chan: tuple[str, str], i: int) -> None:
        msg = self._take(chan, i)
        src, dst = chan
        self._note(lambda: f"{dst} receives {self._fmt(msg)} from {src}")
        if dst == ROUTER:
            epoch = msg.epoch if isinstance(msg, Envelope) else 0
            self._router_receive(src, msg.msg if isinstance(msg, Envelope) else msg, epoch)
            return
        assert not isinstance(msg, Envelope)  # only what goes to the router is stamped
        self._executor(dst).receive(src, msg)

    def _ev_drop(self, chan: tuple[str, str], i: int) -> None:
        msg = self._take(chan, i)
        self._note(lambda: f"lost: {self._fmt(msg)} from {chan[0]} to {chan[1]}")

    def _ev_dup(self, chan: tuple[str, str], i: int) -> None:
        msg = self.net[chan][i]
        self.net[chan] += (msg,)
        self.wire[chan] += (self.wire[chan][i],)
        self._note(lambda: f"duplicated: {self._fmt(msg)} from {chan[0]} to {chan[1]} (the copy comes last)")

    def _ev_land(self, src: str, w: Write) -> None:
        self._remove_write(src, w)
        node = self.decode
        if w.target != node.inc or node.down:
            self._note(lambda: f"write of {self._name(w.rid)} to page {w.page} fails: its decode pool is gone")
            if src == "run":
                self.prefill.runs[w.rid].failed = True
            return
        plane = list(node.plane)
        plane[w.page] = Label(w.rid, w.epoch, w.page, w.tokens, w.corrupt)
        node.plane = tuple(plane)
        self._note(lambda: f"data plane: {self._name(w.rid)}'s KV lands in page {w.page} (tag epoch {w.epoch}, "
                   f"{_tokens(w.tokens)}{', corrupted' if w.corrupt else ''})")
        run = self.prefill.runs.get(w.rid) if src == "run" else None
        if run is not None and run.pending:  # a chunk before the last: the runner reports progress
            self._prefill().progress(w.rid, self.cfg.page_size)

    def _ev_cancel(self, src: str, w: Write) -> None:
        self._remove_write(src, w)
        self._note(lambda: f"runner stopped: {self._name(w.rid)}'s write to page {w.page} is never issued")

    def _ev_fail(self, src: str, w: Write) -> None:
        self._remove_write(src, w)
        self.prefill.runs[w.rid].failed = True
        self._note(lambda: f"data plane: {self._name(w.rid)}'s write to page {w.page} fails")

    def _ev_lose(self, src: str, w: Write) -> None:
        self._remove_write(src, w)
        self._note(lambda: f"data plane: {self._name(w.rid)}'s write to page {w.page} reports success but never lands")

    def _ev_corrupt(self, src: str, w: Write) -> None:
        self._remove_write(src, w)
        self._add_write(src, replace(w, corrupt=True))
        self._note(lambda: f"data plane: {self._name(w.rid)}'s write to page {w.page} will land corrupted")

    def _ev_short(self, rid: int) -> None:
        run = self.prefill.runs[rid]
        victim = next(w for w in run.pending if w.page == run.last_page)
        run.pending = tuple(replace(w, tokens=w.tokens - 1) if w is victim else w for w in run.pending)
        run.tokens -= 1
        run.sums = run.sums[:-1] + (page_sum(rid, victim.page, victim.tokens - 1),)
        run.short = True
        left = _tokens(victim.tokens - 1)
        self._note(lambda: f"prefill runner bug: {self._name(rid)} is computed one token short "
                           f"({_tokens(run.tokens)}); its write to page {victim.page} carries {left}")

    def _ev_finish(self, rid: int) -> None:
        run = self.prefill.runs.pop(rid)
        if run.failed:
            self._note(lambda: f"prefill runner: {self._name(rid)} ended with a data-plane error")
            self._prefill().report(Computed(rid, error=ServiceUnavailable("KV transfer failed")))
        else:
            self._note(lambda: f"prefill runner: every write of {self._name(rid)} has landed ({_tokens(run.tokens)})")
            checksum = transfer_checksum(list(run.sums))
            self._prefill().report(Computed(rid, run.tokens, checksum, [(self._bit(rid), None)]))

    def _ev_step(self, rid: int) -> None:
        """One decode step of ``rid``: the engine checks its page table (always on), then reads its pages."""
        node, seq = self.decode, self.decode.engine[rid]
        pages = node.live.pages
        self._note(lambda: f"decode engine: a step of {self._name(rid)} reads pages {[g.page for g in seq.grants]}")
        if not all(_held_by(pages, rid, g) for g in seq.grants):
            del node.engine[rid]
            pages.quarantine(rid, [g for g in seq.grants if _held_by(pages, rid, g)], "tag mismatch")
            self._note(lambda: f"decode engine: {self._name(rid)}'s page table tags do not match; it fails")
            err = IntegrityError("KV cache verification failed for this request; no output was produced.")
            self._decode().outputs([Reject(rid, ErrorInfo.of(err))])
            return
        self._check_read(seq)
        token = self._bit(rid)
        for g in seq.grants:
            token |= self._bit(node.plane[g.page].rid)
        self._decode().outputs([self._decode_token(seq, token)])

    def _ev_timeout(self, who: str) -> None:
        self._note(lambda: f"{who}: timers fire at t={self.now}")
        (self._router() if who == ROUTER else self._executor(who)).tick()

    def _ev_tick(self) -> None:
        deadline = self._next_deadline()
        assert deadline is not None  # a tick is enabled only when there is one
        self._router().tick()  # its last tick before time passes: the silence of what it heard counts from now
        self.now = deadline
        self._note(lambda: f"time passes: t={self.now}")

    def _ev_crash(self, worker: str) -> None:
        node = self._node(worker)
        node.down, node.noticed, node.core = True, False, None
        for chan in [ch for ch in self.net if ch[1] == worker]:  # its inbox dies with it
            del self.net[chan], self.wire[chan]
        if worker == PREFILL:
            self.zombies += tuple(w for run in self.prefill.runs.values() for w in run.pending)
            self.prefill.runs = {}
            self._note(lambda: f"{worker} crashes; writes it already issued may still land")
        else:
            self.decode.engine = {}
            self._note(lambda: f"{worker} crashes; its pool is gone")

    def _ev_notice(self, worker: str) -> None:
        node = self._node(worker)
        node.noticed = True
        self.net.pop((ROUTER, worker), None)  # the router drops its outbox to the dead worker
        self.wire.pop((ROUTER, worker), None)
        if worker == PREFILL:
            self.zombies = ()  # the process is gone: nothing of it can still write
        self._note(lambda: f"router notices that {worker} died")
        self._router().run(self.router.worker_down(worker))

    def _ev_restart(self, worker: str) -> None:
        node = self._node(worker)
        if not node.noticed:  # back before the router noticed: its heartbeats never stop, so it never will
            node.noticed = True
            if worker == PREFILL:
                self.zombies = ()
            self._note(lambda: f"(the router never notices that {worker} died)")
        node.down, node.inc, node.epoch = False, node.inc + 1, 0  # a new process holds no epoch yet
        if worker == PREFILL:
            self.prefill.core, self.prefill.peers, self.prefill.runs = self._new_prefill_core(), Peers({}), {}
        else:
            self._boot_decode(ghost=False)
        self._note(lambda: f"{worker} restarts (incarnation {node.inc}) with a fresh core and says Hello")
        self._send(worker, ROUTER, self._hello(worker))

    def _ev_fence(self, worker: str) -> None:
        self.net.pop((ROUTER, worker), None)  # the router drops its outbox to the worker it declared dead
        self.wire.pop((ROUTER, worker), None)
        self._note(lambda: f"router declares {worker} dead (it was paused past the worker timeout) and fences it; "
                           "it runs on")
        self._router().run(self.router.worker_down(worker, fenced=True))

    def _ev_heartbeat(self, worker: str) -> None:
        self._note(lambda: f"{worker} sends a heartbeat")
        self._send(worker, ROUTER, self._hello(worker))

    # -- carrying out actions, as the worker loops do ----------------------------------------

    def _router_receive(self, src: str, msg: Message, epoch: int = 0) -> None:
        if isinstance(msg, Reject):
            rid = self.cfg.spec(msg.rid).rid
            client = self.clients.get(rid)
            current = msg.rid in self.router.reqs  # not a Reject of an attempt the router already gave up
            if current and client is not None and not client.ended and not client.gone and client.rejected_by is None:
                self.clients[rid] = client._replace(rejected_by=src, rejected_status=msg.error.status)
        stale = epoch < self.router.epochs.get(src, 0)
        actions = self.router.handle(src, msg, epoch)
        if stale and any(isinstance(a, Deliver) for a in actions):
            self._violate("I7", f"the router delivered to a client what {src} sent under its fenced epoch {epoch}")
        self._router().run(actions)

    def _router(self) -> RouterExecutor:
        return RouterExecutor(self.router, _Clients(self), _Net(self, ROUTER), self._clock)

    def _prefill(self) -> PrefillExecutor:
        return PrefillExecutor(self.prefill.live, _Runner(self), _Net(self, PREFILL), self._clock)

    def _decode(self) -> DecodeExecutor:
        return DecodeExecutor(self.decode.live, _Engine(self), _Net(self, DECODE), self._clock)

    def _executor(self, worker: str) -> PrefillExecutor | DecodeExecutor:
        return self._prefill() if worker == PREFILL else self._decode()

    def _clock(self) -> float:
        return self.now

    def _start_prefill(self, start: StartPrefill) -> None:
        """The runner computes the prompt and issues one write per page (``_Runner.start``)."""
        node = self.prefill
        target = _incarnation(node.peers.decodes[start.decode])
        if target != self.decode.inc or self.decode.down:
            self._note(lambda: f"prefill runner: cannot reach {start.decode}'s pool for {self._name(start.rid)}")
            raise ServiceUnavailable("decode worker unreachable")
        n, ps = len(start.prompt_ids), self.cfg.page_size
        local_pages = -(-n // ps)
        counts = tokens_per_page(n, ps, local_pages)
        writes = tuple(Write(start.rid, page, epoch, tokens, target)
                       for (page, epoch), tokens in zip(start.dest, counts, strict=False))
        node.runs[start.rid] = Run(start.rid, n, writes, writes[-1].page if writes else -1,
                                    tuple(page_sum(w.rid, w.page, w.tokens) for w in writes))
        self._note(lambda: f"prefill runner: computes {self._name(start.rid)} ({_tokens(n)}) and issues writes "
                           f"to pages {[w.page for w in writes]}")

    def _stop_prefill(self, rid: int) -> None:
        run = self.prefill.runs.get(rid)
        if run is not None:
            run.stopped = True
        self._note(lambda: f"prefill runner: stop {self._name(rid)}")

    def _start_decode(self, a: StartDecode) -> list[Output | Reject]:
        seq = Seq(a.admit.rid, tuple(a.grants), len(a.admit.prompt_ids), a.admit.params.max_tokens)
        self.decode.engine[seq.rid] = seq
        self._note(lambda: f"decode engine: takes {self._name(seq.rid)} with pages {[g.page for g in a.grants]}")
        return [self._decode_token(seq, a.done.first_token)]

    def _stop_decode(self, rid: int) -> None:
        seq = self.decode.engine.pop(rid, None)
        if seq is not None:
            self.decode.live.pages.free(rid, list(seq.grants))
        self._note(lambda: f"decode engine: drops {self._name(rid)} and frees its pages")

    def _decode_token(self, seq: Seq, token: int) -> Output:
        seq.produced += 1
        finished = seq.produced >= seq.max_tokens
        if finished:
            del self.decode.engine[seq.rid]
            self.decode.live.pages.free(seq.rid, list(seq.grants))
        self._note(lambda: f"decode engine: {self._name(seq.rid)} token {seq.produced} = {self._token_name(token)}"
                   + (" (finished; pages freed)" if finished else ""))
        return Output(seq.rid, [token], "", "length" if finished else None, seq.prompt_len, seq.produced)

    def _send(self, src: str, dst: str, msg: Message) -> None:
        self._note(lambda: f"  {src} -> {dst}: {self._fmt(msg)}")
        sent: Message | Envelope = msg
        if dst == ROUTER and self._node(src).epoch:
            sent = Envelope(src, msg, self._node(src).epoch)  # stamped, as a channel does
        chan = (src, dst)
        self.net[chan] = self.net.get(chan, ()) + (sent,)
        self.wire[chan] = self.wire.get(chan, ()) + (_enc(sent),)

    def _deliver_to_client(self, d: Deliver) -> None:
        client = self.clients.get(d.rid)
        if client is None or client.gone:
            return  # the HTTP handler is gone; nobody reads it
        name, spec = self._name(d.rid), self.cfg.spec(d.rid)
        if client.ended:
            self._violate("I4", f"client {name} got a second ending after its first ({client.status})")
            return
        if d.error is not None:
            err = d.error
            self._note(lambda: f"  client {name} <- HTTP {err.status} {err.code or err.type}")
            self.clients[d.rid] = client._replace(status=err.status, code=err.code)
            client_fault = client.rejected_status is not None and 400 <= client.rejected_status < 500
            if self.cfg.router_sees_over_length(spec) and err.status != 400:
                self._violate("I3", f"over-length request {name} got HTTP {err.status}, not 400 "
                                    "context_length_exceeded")
            elif client_fault and not 400 <= err.status < 500:
                self._violate("I3", f"{client.rejected_by} rejected {name} with HTTP {client.rejected_status} "
                                    f"(the client's fault), but the client got HTTP {err.status}")
            elif not self.cfg.over_length(spec) and 400 <= err.status < 500:
                self._violate("I3", f"request {name} fits every limit but got HTTP {err.status} (client's fault)")
            return
        out = d.output
        assert out is not None  # a Deliver carries an error or an output
        self._note(lambda: f"  client {name} <- tokens {[self._token_name(t) for t in out.token_ids]}"
                   + (f" (finished: {out.finish_reason})" if out.finish_reason else ""))
        if client.rejected_by is not None:
            self._violate("I3", f"{client.rejected_by} rejected {name}, yet its client receives tokens")
        if self.cfg.over_length(spec):
            self._violate("I3", f"over-length request {name} is answered with tokens (HTTP 200), not a 400")
        for t in out.token_ids:
            foreign = sorted({self._tenant_of_bit(b) for b in _bits(t)} - {spec.tenant})
            if foreign:
                self._violate("I6", f"client {name} (tenant {spec.tenant}) receives a token computed from KV of "
                                    f"tenant {', '.join(foreign)}")
        status = 200 if out.finish_reason is not None else None
        self.clients[d.rid] = client._replace(tokens=client.tokens + tuple(out.token_ids), status=status)

    # -- invariant checks that watch transitions -----------------------------------------------

    def _check_read(self, seq: Seq) -> None:
        """I1: every page a decode step reads is rid's, under its grant, and holds rid's own KV."""
        pages, name = self.decode.live.pages, self._name(seq.rid)
        counts = tokens_per_page(seq.prompt_len, self.cfg.page_size, len(seq.grants))
        for g, tokens in zip(seq.grants, counts, strict=True):
            label = self.decode.plane[g.page]
            if not _held_by(pages, seq.rid, g):
                self._violate("I1", f"{name} reads page {g.page}, which the page table no longer gives it")
            elif (label.rid, label.epoch, label.page) != (seq.rid, g.epoch, g.page):
                who = self._writer(label)
                self._violate("I1", f"{name} decodes from page {g.page}, which holds {who}, not its own KV "
                                    f"(grant epoch {g.epoch})")
            elif label.tokens < tokens:
                self._violate("I1", f"{name} decodes from page {g.page}, where only {label.tokens} of its "
                                    f"{tokens} tokens were written; the rest is stale KV")
            elif label.corrupt:
                self._violate("I1", f"{name} decodes from page {g.page}, whose bytes were corrupted in transit")

    def _violate(self, invariant: str, message: str) -> None:
        self.violations.append(Violation(invariant, message))
        self._note(lambda: f"  !! {invariant} violated: {message}")

    # -- helpers -------------------------------------------------------------------------------

    def _node(self, worker: str) -> PrefillNode | DecodeNode:
        return self.prefill if worker == PREFILL else self.decode

    def _take(self, chan: tuple[str, str], i: int) -> Message | Envelope:
        queue, wire = self.net[chan], self.wire[chan]
        msg = queue[i]
        if len(queue) > 1:
            self.net[chan] = queue[:i] + queue[i + 1:]
            self.wire[chan] = wire[:i] + wire[i + 1:]
        else:
            del self.net[chan], self.wire[chan]
        return msg

    def _remove_write(self, src: str, w: Write) -> None:
        if src == "zombie":
            i = self.zombies.index(w)
            self.zombies = self.zombies[:i] + self.zombies[i + 1:]
        else:
            run = self.prefill.runs[w.rid]
            i = run.pending.index(w)
            run.pending = run.pending[:i] + run.pending[i + 1:]

    def _add_write(self, src: str, w: Write) -> None:
        if src == "zombie":
            self.zombies += (w,)
        else:
            self.prefill.runs[w.rid].pending += (w,)

    def _note(self, line) -> None:
        """Record what happened, for traces (``line`` is called only when a log is kept)."""
        if self.log is not None:
            self.log.append(line())

    def _fmt(self, msg: Message | Envelope) -> str:
        if isinstance(msg, Envelope):
            return f"{self._fmt(msg.msg)} (epoch {msg.epoch})"
        return fmt(msg, {r.rid: r.name for r in self.cfg.requests} | {retry_rid(r.rid): r.name + "'" for r in
                                                                        self.cfg.requests} | {GHOST_RID: "ghost"})

    def _name(self, rid: int) -> str:
        if rid == GHOST_RID:
            return "ghost"
        for r in self.cfg.requests:
            if rid in (r.rid, retry_rid(r.rid)):
                return r.name + ("" if rid == r.rid else "'")  # A' is A's retry
        return str(rid)

    def _writer(self, label: Label) -> str:
        if label.rid == 0:
            return "never-written memory"
        if label.rid == GHOST_RID:
            return f"KV left by an earlier request of tenant {GHOST_TENANT}"
        spec = self.cfg.spec(label.rid)
        return f"KV of {spec.name} (tenant {spec.tenant}, epoch {label.epoch})"

    # Token ids carry where their KV came from: one bit per request (and the ghost) it was computed from.
    def _bit(self, rid: int) -> int:
        if rid == 0:
            return 0
        if rid == GHOST_RID:
            return 1 << len(self.cfg.requests)
        return 1 << next(i for i, r in enumerate(self.cfg.requests) if rid in (r.rid, retry_rid(r.rid)))

    def _tenant_of_bit(self, bit: int) -> str:
        if bit == len(self.cfg.requests):
            return GHOST_TENANT
        return self.cfg.requests[bit].tenant

    def _token_name(self, token: int) -> str:
        names = [self.cfg.requests[b].name if b < len(self.cfg.requests) else "ghost" for b in _bits(token)]
        return "kv(" + "+".join(names) + ")"


class _Digest:
    """blake2b-128 of a pickle made without memo, so that it depends on values alone, never on object identity."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.pickler = pickle.Pickler(self.buf, protocol=5)
        self.pickler.fast = True

    def __call__(self, parts: tuple) -> bytes:
        buf = self.buf
        buf.seek(0)
        buf.truncate()
        self.pickler.dump(parts)
        return hashlib.blake2b(buf.getbuffer(), digest_size=16).digest()


_digest = _Digest()


def _wkey(w: Write) -> tuple:
    return (w.rid, w.page, w.epoch, w.tokens, w.target, w.corrupt)


def _lkey(label: Label) -> tuple:
    return (label.rid, label.epoch, label.page, label.tokens, label.corrupt)


_enc = msgspec.json.Encoder().encode
_ATOMS = (int, str, bool, float, bytes, type(None))
_SKIP = frozenset({"me", "router", "limits", "safety", "verify", "emulate_incident", "max_context", "num_pages",
                   "request", "stale_messages"})


def canon(obj, now: float):
    """A core (or anything inside one) as nested tuples of atoms, generically: new fields are picked up."""
    t = type(obj)
    f = _CANON.get(t)
    if f is None:
        f = _CANON[t] = _canon_for(t)
    return f(obj, now)


def _canon_for(t: type):
    if t in _ATOMS:
        return _atom
    if issubclass(t, msgspec.Struct):
        return lambda obj, now: _enc(obj)
    if issubclass(t, Enum):
        return lambda obj, now: obj._value_
    if t is dict:
        return _canon_dict
    if t in (list, tuple, deque):
        return lambda obj, now: tuple([canon(x, now) for x in obj])
    if t in (set, frozenset):
        return lambda obj, now: tuple(sorted(canon(x, now) for x in obj))
    if t is np.ndarray:
        return lambda obj, now: obj.tobytes()
    if t is PageGrant:
        return lambda obj, now: (obj.page, obj.epoch)
    return _canon_object


def _atom(obj, now):
    return obj


def _canon_dict(obj: dict, now: float) -> tuple:
    """In insertion order: cores iterate their tables, so the order can decide the order of messages."""
    return tuple([(k if type(k) in _ATOMS else canon(k, now), canon(v, now)) for k, v in obj.items()])


def _canon_object(obj, now: float) -> tuple:
    d = obj.__dict__
    state = d.get("state")
    timed = type(state) in (PState, DState) and state in TIMED
    t = type(obj)
    names = _NAMES.get(t)
    if names is None or len(names[1]) != len(d):
        names = _NAMES[t] = (tuple(k for k in sorted(d) if k not in _SKIP), tuple(d))
    out: list[object] = [t.__name__]
    for k in names[0]:
        v = d[k]
        if k == "deadline":
            out.append(v - now if timed else None)
        elif k == "quiet_since":  # the router's: relative, and moot once the request was heard since
            out.append(None if v is None or d["heard"] else v - now)
        elif k == "absent_since":
            out.append(tuple((role, t - now) for role, t in v.items()))
        else:
            out.append(canon(v, now))
    return tuple(out)


_CANON: dict[type, Callable[[Any, float], object]] = {}
_NAMES: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def _bits(token: int) -> list[int]:
    return [b for b in range(token.bit_length()) if token >> b & 1]


GRANTED, READY = int(PageState.GRANTED), int(PageState.READY)


def _held_by(pages: PageTable, rid: int, g: PageGrant) -> bool:
    state = pages.state[g.page]
    return GRANTED <= state <= READY and pages.owner_of(g.page) == rid and int(pages.epoch[g.page]) == g.epoch


# -- readable messages --------------------------------------------------------------------------


def fmt(msg: Message, names: dict[int, str] | None = None) -> str:
    """A message in one short line: its type and the fields that matter."""
    name = type(msg).__name__
    fields = msgspec.structs.asdict(msg)
    parts = []
    for k, v in fields.items():
        if k in ("params", "text", "prompt_tokens", "completion_tokens", "control", "side", "queued_tokens",
                 "running", "free_pages", "max_context", "pool_tokens", "pid", "weight") and name != "Peers":
            continue
        if k == "rid":
            v = (names or {}).get(v, v)
        elif k == "prompt_ids":
            k, v = "prompt", f"{len(v)} tokens"
        elif k == "error":
            v = f"{v.status} {v.code or v.type}"
        elif k == "pages":
            v = ",".join(f"{p}@e{e}" for p, e in v)
        parts.append(f"{k}={v}")
    return f"{name}({', '.join(parts)})"


# -- copying worlds ---------------------------------------------------------------------------


def _copy_obj(obj):
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


def _copy_router(core: RouterCore) -> RouterCore:
    new = _copy_obj(core)
    new.reqs = {k: _copy_obj(v) for k, v in core.reqs.items()}
    new.workers = {k: _copy_obj(v) for k, v in core.workers.items()}
    new.queue = _copy_queue(core.queue)
    new.drained, new.absent_since = set(core.drained), dict(core.absent_since)
    new.suspected, new.epochs, new.fenced, new.retried = (set(core.suspected), dict(core.epochs), dict(core.fenced),
                                                          set(core.retried))
    _copy_extra(core, new, ("me", "max_context", "safety", "reqs", "workers", "queue", "drained", "absent_since",
                            "limits", "silence_timeout", "suspected", "epochs", "fenced", "retried",
                            "stale_messages"))
    return new


def _copy_queue(q: FairQueue) -> FairQueue:
    new = _copy_obj(q)
    new.queues = {t: type(d)(d) for t, d in q.queues.items()}  # entries are never changed: shared
    new.tenant_of, new.started = dict(q.tenant_of), dict(q.started)
    new.shares = _copy_shares(q.shares)
    new.buckets = {t: _copy_obj(b) for t, b in q.buckets.items()}
    _copy_extra(q, new, ("policy", "queues", "tenant_of", "started", "shares", "buckets", "arrivals"))
    return new


def _copy_shares(shares: FairShares) -> FairShares:
    new = _copy_obj(shares)
    new.served = dict(shares.served)
    return new


def _copy_prefill(node: PrefillNode) -> PrefillNode:
    new = _copy_obj(node)
    new.runs = {k: _copy_obj(v) for k, v in node.runs.items()}
    if node.core is not None:
        new.core = _copy_obj(node.core)
        new.core.reqs = {k: _copy_obj(v) for k, v in node.core.reqs.items()}
        _copy_extra(node.core, new.core, ("me", "router", "limits", "safety", "emulate_incident", "reqs"))
    return new


def _copy_decode(node: DecodeNode) -> DecodeNode:
    new = _copy_obj(node)
    new.engine = {k: _copy_obj(v) for k, v in node.engine.items()}
    if node.core is not None:
        core = node.core
        c = new.core = _copy_obj(core)
        c.reqs = {k: _copy_obj(v) for k, v in core.reqs.items()}
        for r in c.reqs.values():
            r.grants = list(r.grants)
        c.waiting = type(core.waiting)(core.waiting)
        c.held = dict(core.held)
        c.shares = _copy_shares(core.shares)
        c.pages = _copy_pages(core.pages)
        verify = core.verify
        assert isinstance(verify, PlaneVerifier)  # a World's decode cores verify with one
        c.verify = PlaneVerifier(new, verify.safety, verify.page_size)
        _copy_extra(core, c, ("me", "router", "pages", "limits", "safety", "verify", "reqs", "waiting", "held",
                              "shares"))
    return new


def _copy_pages(t: PageTable) -> PageTable:
    new = _copy_obj(t)
    for name, value in t.__dict__.items():
        if isinstance(value, np.ndarray):
            setattr(new, name, value.copy())
    new.quarantine_reason = dict(t.quarantine_reason)
    new._free = type(t._free)(t._free)
    new.holders = {page: set(h) for page, h in t.holders.items()}
    _copy_extra(t, new, ("num_pages", "owner_hi", "owner_lo", "epoch", "filled", "state", "quarantine_reason",
                         "_free", "holders"))
    return new


def _copy_extra(old, new, known: tuple[str, ...]) -> None:
    """Attributes this cloner does not know yet are deep-copied, so a new field in a core is never shared."""
    import copy

    if len(old.__dict__) > len(known):
        for name in old.__dict__.keys() - set(known):
            setattr(new, name, copy.deepcopy(getattr(old, name)))

