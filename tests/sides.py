"""The role's part of a hand-built ``Hello``: tests of the router's core need no real data plane behind it."""

from __future__ import annotations

from kvfence.descriptors import ShmDescriptor
from kvfence.protocol.messages import DecodeSide, PrefillSide


def target(name: str = "pool") -> DecodeSide:
    """A decode worker's side, naming a shm region ``name`` (another name: another pool, as after a restart)."""
    return DecodeSide(ShmDescriptor(nbytes=0, path=name, pid=0), kv_pages=1)


def side(role: str) -> PrefillSide | DecodeSide:
    """``role``'s side: a prefill that holds no Peers yet, or a decode's ``target()``."""
    return PrefillSide("") if role == "prefill" else target()
