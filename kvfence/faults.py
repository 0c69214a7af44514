"""Fault injection for soak tests: ``KVFENCE_FAULTS`` makes the control and data planes misbehave on purpose.

``KVFENCE_FAULTS="drop=0.002,dup=0.002,delay=0.01,delay_s=0.3,flip=0.01,seed=7"`` (each part optional):

- ``drop``, ``dup``: probability that a control message is lost, or delivered twice.
- ``delay``: probability that a control message is held back up to ``delay_s`` seconds. The link to that peer
  stays in order (later messages wait behind it), like a latency spike on a TCP connection.
- ``flip``: probability that a KV transfer lands with one byte flipped (applied by decode on landing, before
  verification, so it stands for corruption anywhere on the data plane).
- ``slow_step``: seconds that every decode step with work to do takes on top (a slow or overloaded worker; tests
  use it to keep streams alive long enough to kill a worker under them).

Heartbeats are never touched: they have their own socket. Off unless the variable is set; every process that
injects faults says so at start.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field, fields
from typing import Any

from kvfence import env


@dataclass(frozen=True)
class Faults:
    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.3
    flip: float = 0.0
    slow_step: float = 0.0
    seed: int | None = None

    @classmethod
    def from_env(cls, value: str | None = None) -> Faults | None:
        """The faults ``KVFENCE_FAULTS`` asks for; ``None`` when it is unset or empty."""
        value = env.faults() if value is None else value
        if not value.strip():
            return None
        known = [f.name for f in fields(cls)]
        kwargs: dict[str, Any] = {}  # each field's own type: seed an int, the rest floats
        for part in value.split(","):
            name, _, number = part.strip().partition("=")
            if name not in known or not number:
                raise ValueError(f"KVFENCE_FAULTS: expected NAME=NUMBER with NAME in {', '.join(known)}; got {part!r}")
            kwargs[name] = int(number) if name == "seed" else float(number)
        faults = cls(**kwargs)
        for name in ("drop", "dup", "delay", "flip"):
            if not 0 <= getattr(faults, name) <= 1:
                raise ValueError(f"KVFENCE_FAULTS: {name} is a probability, got {getattr(faults, name)}")
        if not 0 <= faults.slow_step <= 10:
            raise ValueError(f"KVFENCE_FAULTS: slow_step is 0 to 10 seconds, got {faults.slow_step}")
        return faults

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name))

    def rng(self, salt: str) -> random.Random:
        """A generator per process and purpose: seeded runs repeat, yet two processes do not fault in lockstep."""
        return random.Random(None if self.seed is None else f"{self.seed}:{salt}")


@dataclass(order=True)
class _Held:
    due: float
    order: int
    to: str = field(compare=False)
    data: bytes = field(compare=False)


class FaultyLink:
    """Decides the fate of each outgoing control message and holds delayed ones until they are due.

    Sans-IO: ``outgoing`` says which (peer, bytes) to send now; ``due`` releases held ones. A peer with
    anything held gets every later message held behind it, so each link stays in order.
    """

    def __init__(self, faults: Faults, salt: str) -> None:
        self.faults = faults
        self.random = faults.rng(salt)
        self.held: list[_Held] = []
        self.held_per_peer: dict[str, int] = {}
        self.counts = {"sent": 0, "dropped": 0, "duplicated": 0, "delayed": 0}
        self._order = 0

    def outgoing(self, to: str, data: bytes, now: float) -> list[tuple[str, bytes]]:
        f, r = self.faults, self.random
        self.counts["sent"] += 1
        if r.random() < f.drop:
            self.counts["dropped"] += 1
            return []
        copies = 2 if r.random() < f.dup else 1
        self.counts["duplicated"] += copies - 1
        behind = self._latest_due(to)  # anything held for this peer goes first
        if r.random() < f.delay:
            self.counts["delayed"] += 1
            self._hold(to, data, max(now + r.uniform(0, f.delay_s), behind or 0.0), copies)
            return []
        if behind is not None:
            self._hold(to, data, behind, copies)
            return []
        return [(to, data)] * copies

    def due(self, now: float) -> list[tuple[str, bytes]]:
        out = []
        while self.held and self.held[0].due <= now:
            h = heapq.heappop(self.held)
            self.held_per_peer[h.to] -= 1
            out.append((h.to, h.data))
        return out

    def _latest_due(self, to: str) -> float | None:
        if not self.held_per_peer.get(to):
            return None
        return max(h.due for h in self.held if h.to == to)

    def _hold(self, to: str, data: bytes, due: float, copies: int) -> None:
        for _ in range(copies):
            self._order += 1
            heapq.heappush(self.held, _Held(due, self._order, to, data))
            self.held_per_peer[to] = self.held_per_peer.get(to, 0) + 1


def flip_one_byte(region: memoryview, start: int, length: int, rng: random.Random) -> int:
    """Invert one byte in ``region[start:start+length]``; returns its offset."""
    offset = start + rng.randrange(length)
    region[offset] ^= 0xFF
    return offset
