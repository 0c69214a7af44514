"""The invariants of docs/protocol.md, as checks on one explored state.

Checks that need a transition rather than a state live where the transition
happens (``world.py``): I1 at every decode step (``World._check_read``), I3
and I6 at every delivery to a client, "exactly once" of I4 at every ending.
The rest is here:

- I2 no early reuse: no page is held under a grant other than the one a
  still-pending write was issued for.
- I4 nothing hangs: a state that is not quiescent has some progress event
  (faults do not count: the environment may never do them). That every
  request can still end from every state is checked over the whole state
  graph by the explorer.
- I5 nothing leaked: the page table is consistent in every state (the
  production ``check_integrity`` plus: held pages are exactly those of live
  grants); at quiescence nothing is held and every router count is zero.
"""

from __future__ import annotations

from kvfence.kvcache.pages import PageError, PageState
from kvfence.verify.world import DECODE, FAULTS, GRANTED, PREFILL, READY, ROUTER, Event, Violation, World

QUARANTINED = int(PageState.QUARANTINED)

NAMES = {
    "I1": "no stale read",
    "I2": "no early reuse",
    "I3": "honest status",
    "I4": "one ending, nothing hangs",
    "I5": "nothing leaked",
    "I6": "tenant binding",
    "I7": "fenced epochs are heard no more",
    "E": "a protocol core raised",
}


def check_state(w: World) -> list[Violation]:
    return no_early_reuse(w) + integrity(w) + (nothing_leaked(w) if w.quiescent() else [])


def no_early_reuse(w: World) -> list[Violation]:
    """I2: a page held by a grant receives no write issued for another grant."""
    node = w.decode
    if node.down:
        return []
    pages = node.live.pages
    out = []
    for _src, wr in w._writes():
        if wr.target != node.inc:
            continue
        p = wr.page
        if not GRANTED <= pages.state[p] <= READY:
            continue
        owner, epoch = pages.owner_of(p), int(pages.epoch[p])
        if (owner, epoch) != (wr.rid, wr.epoch):
            out.append(Violation("I2", f"page {p} is held by {w._name(owner)} (epoch {epoch}) while a write of "
                                       f"{w._name(wr.rid)} for its grant epoch {wr.epoch} may still land"))
    return out


def integrity(w: World) -> list[Violation]:
    """I5 in every state: the page table is consistent and holds exactly the pages of live grants.

    Checked where a core changed (``World.changed``, filled by ``key()``): the rest was checked before.
    """
    out = []
    node = w.decode
    if not node.down and DECODE in w.changed:
        pages, core = node.live.pages, node.live
        try:
            pages.check_integrity()
        except PageError as exc:
            out.append(Violation("I5", f"decode page table: {exc}"))
        granted = sorted(core.granted_pages()
                         + [g.page for s in node.engine.values() for g in s.grants])
        held = [p for p, state in enumerate(pages.state.tolist()) if GRANTED <= state <= READY]
        if granted != held:
            out.append(Violation("I5", f"pages held {held} differ from pages of live requests {granted}"))
        for rid, (_writer, held) in core.held.items():
            if any(pages.state[p] != QUARANTINED for p in held):
                out.append(Violation("I5", f"{w._name(rid)}'s pages {held} are recorded as quarantined but not"))
    for worker, info in w.router.workers.items() if ROUTER in w.changed else ():
        n = sum(1 for r in w.router.reqs.values() if worker in (r.prefill, r.decode))
        if info.in_flight != n:
            out.append(Violation("I5", f"router counts {info.in_flight} requests in flight on {worker}, has {n}"))
    return out


def nothing_leaked(w: World) -> list[Violation]:
    """I5 at quiescence: every page free or quarantined with a reason, every table empty."""
    out = []
    pages = w.decode.live.pages
    for p in range(pages.num_pages):
        state = PageState(pages.state[p])
        if state not in (PageState.FREE, PageState.QUARANTINED):
            out.append(Violation("I5", f"at quiescence page {p} is still {state.name.lower()}"))
        elif state is PageState.QUARANTINED and not pages.quarantine_reason.get(p):
            out.append(Violation("I5", f"at quiescence page {p} is quarantined without a reason"))
    if w.prefill.live.reqs or w.decode.live.reqs or w.router.reqs:
        out.append(Violation("I5", "at quiescence a request table is not empty"))
    return out


def stuck(w: World, events: list[Event]) -> Violation | None:
    """I4: not quiescent, yet nothing but a fault can happen."""
    if any(ev[0] not in FAULTS for ev in events) or w.quiescent():
        return None
    return Violation("I4", "deadlock: nothing but a fault can happen, yet " + pending(w))


def pending(w: World) -> str:
    """What has not ended yet, in words."""
    parts = []
    for spec in w.cfg.requests:
        c = w.clients[spec.rid]
        if c.submitted and not c.ended and not c.gone:
            parts.append(f"client {spec.name} is still waiting")
    if w.router.reqs:
        parts.append("router still holds " + ", ".join(w._name(r) for r in w.router.reqs))
    for worker, node in ((PREFILL, w.prefill), (DECODE, w.decode)):
        if node.down:
            parts.append(f"{worker} is down")
        elif node.live.reqs:
            parts.append(f"{worker} still holds " + ", ".join(
                f"{w._name(rid)} ({r.state.value})" for rid, r in node.live.reqs.items()))
    if w.decode.engine:
        parts.append("decode engine still runs " + ", ".join(w._name(r) for r in w.decode.engine))
    if w.prefill.runs or w.zombies:
        parts.append("writes are still pending")
    if w.net:
        parts.append(f"{sum(map(len, w.net.values()))} message(s) in flight")
    return "; ".join(parts) or "nothing is pending"
