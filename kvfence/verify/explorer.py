"""Breadth-first exploration of every state the real protocol cores can reach in a ``CheckConfig``.

States are deduplicated by ``World.key()``. Breadth-first order means the
first violation found has a shortest trace; it is replayed from the start
with logging on, so each step says what happened and what it sent.

After a complete exploration without a safety violation, the second half of
I4 is checked on the state graph: from every reachable state, progress
events alone (no fault) lead to a quiescent state, i.e. every request can
still end.
"""

from __future__ import annotations

import functools
import gc
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfence.verify.invariants import NAMES, check_state, pending, stuck
from kvfence.verify.world import FAULTS, CheckConfig, Event, Violation, World


@dataclass
class Step:
    lines: list[str]  # what the event did; the first line says what it was


@dataclass
class Result:
    config: CheckConfig
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    complete: bool = False  # every reachable state explored (no cap hit, no violation stopped it)
    quiescent: int = 0  # states where every request has ended everywhere
    quarantining: int = 0  # ... of which some page stays quarantined
    violation: Violation | None = None
    trace: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violation is None and self.complete

    def report(self) -> str:
        lines = [f"config: {self.config.describe()}"]
        status = "complete" if self.complete else "stopped early"
        lines.append(f"explored {self.states:,} states, {self.transitions:,} transitions, depth {self.depth}, "
                     f"in {self.seconds:.1f}s ({status}); {self.quiescent:,} quiescent states, "
                     f"{self.quarantining:,} of them with pages quarantined")
        if self.violation is None:
            lines.append("no violation" + ("" if self.complete else " found so far (state cap reached)"))
            return "\n".join(lines)
        v = self.violation
        lines += violation_lines(v.invariant, NAMES[v.invariant], v.message, [step.lines for step in self.trace])
        return "\n".join(lines)


def violation_lines(invariant: str, name: str, message: str, steps: list[list[str]]) -> list[str]:
    """A violation as reported: each step of its shortest trace (what the event was, then what it did), then the
    invariant and why it failed."""
    lines = [f"VIOLATION of {invariant} ({name}) after {len(steps)} steps:"]
    for i, step in enumerate(steps, 1):
        lines.append(f"{i:3d}. {step[0]}")
        lines += [f"       {line.strip()}" for line in step[1:]]
    lines.append(f"  => {invariant} ({name}): {message}")
    return lines


Progress = Callable[[Result, int], None]


def without_cycle_collection(fn: Callable) -> Callable:
    """Run ``fn`` with Python's cycle collector paused. Worlds form no reference cycles (tests/test_verify.py
    checks), so reference counts free every state dropped, and the collector's passes over the hundreds of thousands
    of states kept were pure cost: a third of the default configuration's exploration."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return run


@without_cycle_collection
def explore(cfg: CheckConfig, max_states: int = 2_000_000, liveness: bool = True,
            progress: Progress | None = None, progress_every: int = 20_000,
            invariants: frozenset[str] | None = None) -> Result:
    """Explore breadth-first; stop at the first violation (its trace is a shortest one).

    ``invariants`` limits which invariants count (all of I1-I7 and E by default), e.g. to look past
    the wrong status of an over-length request for the stale read behind it.
    """
    wanted = frozenset(NAMES) if invariants is None else invariants
    res = Result(cfg)
    t0 = time.monotonic()
    init = World(cfg)
    seen: dict[bytes, int] = {init.key(): 0}
    parent = array("q", [-1])
    via: list[Event | None] = [None]
    edges_src, edges_dst = array("I"), array("I")
    quiescent = array("I")
    frontier: list[tuple[int, World]] = [(0, init)]
    found: tuple[int, Event | None, Violation] | None = None
    for v in check_state(init):
        if v.invariant in wanted:
            found = (0, None, v)
    depth = 0
    while frontier and found is None:
        nxt: list[tuple[int, World]] = []
        for sid, w in frontier:
            if w.quiescent():
                quiescent.append(sid)
                res.quarantining += bool(w.decode.live.pages.num_quarantined)
            events = w.events()
            dead = stuck(w, events)
            if dead is not None and dead.invariant in wanted:
                found = (sid, None, dead)
                break
            for ev in events:
                w2 = w.clone()
                try:
                    w2.apply(ev)
                except Exception as exc:  # a core (or the model) raised: a worker would crash here
                    if "E" not in wanted:
                        continue
                    found = (sid, ev, Violation("E", f"{type(exc).__name__}: {exc}"))
                    break
                res.transitions += 1
                k = w2.key()
                nid = seen.get(k)
                new = nid is None
                if nid is None:
                    nid = len(parent)
                    seen[k] = nid
                    parent.append(sid)
                    via.append(ev)
                if ev[0] not in FAULTS:
                    edges_src.append(sid)
                    edges_dst.append(nid)
                seen_here = [v for v in w2.violations if v.invariant in wanted]
                if seen_here:
                    found = (sid, ev, seen_here[0])
                    break
                if not new:
                    continue
                state_violations = [v for v in check_state(w2) if v.invariant in wanted]
                if state_violations:
                    found = (nid, None, state_violations[0])
                    break
                nxt.append((nid, w2))
                if progress is not None and nid % progress_every == 0:
                    res.states, res.depth, res.seconds = len(parent), depth + 1, time.monotonic() - t0
                    progress(res, len(frontier) + len(nxt))
                if len(parent) >= max_states:
                    break
            if found is not None or len(parent) >= max_states:
                break
        if found is None and len(parent) >= max_states:
            frontier = []
            break
        frontier = nxt
        if frontier:
            depth += 1
    res.states, res.depth = len(parent), depth
    res.quiescent = len(quiescent)
    if found is None and len(parent) < max_states:
        res.complete = True
        if liveness and "I4" in wanted:
            found = _liveness(len(parent), edges_src, edges_dst, quiescent, parent, via, cfg)
            res.complete = found is None
    if found is not None:
        sid, final, v = found
        res.violation = v
        res.trace = _trace(cfg, _path(parent, via, sid) + ([final] if final is not None else []))
        if v.invariant == "I4" and not v.message.startswith("deadlock"):
            last = _replay(cfg, _path(parent, via, sid))
            res.violation = Violation("I4", v.message + "; here " + pending(last))
    res.seconds = time.monotonic() - t0
    return res


def _liveness(n: int, src: array, dst: array, quiescent: array, parent: array, via: list,
              cfg: CheckConfig) -> tuple[int, None, Violation] | None:
    """I4: every state reaches a quiescent state by progress events alone. Backwards from the quiescent ones."""
    order = sorted(range(len(dst)), key=dst.__getitem__)
    start = array("I", [0]) * (n + 1)
    for i in order:
        start[dst[i] + 1] += 1
    for i in range(n):
        start[i + 1] += start[i]
    preds = array("I", [0]) * len(order)
    for pos, i in enumerate(order):
        preds[pos] = src[i]
    can_end = bytearray(n)
    stack = list(quiescent)
    for s in stack:
        can_end[s] = 1
    while stack:
        s = stack.pop()
        for j in range(start[s], start[s + 1]):
            p = preds[j]
            if not can_end[p]:
                can_end[p] = 1
                stack.append(p)
    bad = can_end.find(0)
    if bad < 0:
        return None
    return (bad, None, Violation("I4", "from this state no run of progress events (without faults) ends "
                                       "every request"))


def _path(parent: array, via: list, sid: int) -> list[Event]:
    events = []
    while sid > 0:
        events.append(via[sid])
        sid = parent[sid]
    return events[::-1]


def _replay(cfg: CheckConfig, events: list[Event]) -> World:
    w = World(cfg)
    for ev in events:
        w.apply(ev)
    return w


def _trace(cfg: CheckConfig, events: list[Event]) -> list[Step]:
    w = World(cfg)
    steps = []
    for ev in events:
        w.log = []
        try:
            w.apply(ev)
        except Exception as exc:
            w.log.append(f"  !! raised {type(exc).__name__}: {exc}")
        steps.append(Step(w.log or [str(ev)]))
        w.violations = []
    return steps
