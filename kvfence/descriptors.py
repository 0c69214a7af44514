"""What a KV target tells initiators: one typed descriptor per transfer backend, tagged by ``kind``.

A decode worker's ``KVTarget.descriptor()`` makes one; it travels in the decode worker's ``Hello`` and the router's
``Peers`` (``protocol/messages.py``) to prefill workers, whose ``KVInitiator.connect`` opens it. Ground floor:
it imports only msgspec, so the protocol messages and the data plane share it without knowing each other.

Descriptors are frozen and hashable: an initiator keys its peer cache by the descriptor itself, so a target that
restarted (a new path, id, session or agent) is a new peer.
"""

from __future__ import annotations

import msgspec


class BaseDescriptor(msgspec.Struct, frozen=True, tag_field="kind"):
    """Fields every backend's descriptor has."""

    nbytes: int  # the target region's size: initiators refuse segments beyond it

    @property
    def kind(self) -> str:
        """The backend that made it (its tag): "shm", "tcp", "mooncake" or "nixl"."""
        tag = type(self).__struct_config__.tag
        assert isinstance(tag, str)  # every concrete descriptor below has a string tag
        return tag


class ShmDescriptor(BaseDescriptor, frozen=True, tag="shm"):
    """A shared-memory file on this host, locked by the target process while it lives."""

    path: str
    pid: int  # the target's process, named in errors


class TcpDescriptor(BaseDescriptor, frozen=True, tag="tcp"):
    """A listening socket; ``id`` (hex) names this target, so a stale descriptor's hello is refused."""

    host: str
    port: int
    id: str
    members_only: bool = False  # the target admits only initiators holding the cluster key


class MooncakeDescriptor(BaseDescriptor, frozen=True, tag="mooncake"):
    """A Mooncake engine's session and the registered region's base address in it."""

    session: str  # "host:rpc_port"
    protocol: str  # the engine's transport ("tcp", "rdma"): initiator and target must agree
    base: int


class NixlDescriptor(BaseDescriptor, frozen=True, tag="nixl"):
    """A NIXL agent's metadata and the registered region's base address."""

    agent: str
    metadata: str  # base64 of the agent's metadata
    base: int


Descriptor = ShmDescriptor | TcpDescriptor | MooncakeDescriptor | NixlDescriptor
