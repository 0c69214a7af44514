"""``mooncake``: the Mooncake transfer engine (``mooncake-transfer-engine-non-cuda``), TCP or RDMA, P2P handshake.

Each side runs one ``TransferEngine`` initialised with ``P2PHANDSHAKE`` (no
metadata server: peers exchange segment descriptors over the engine's own RPC
port) and registers its region. The target's descriptor carries its session
name ``host:rpc_port`` and the region's virtual address; the initiator writes
with ``batch_transfer_sync_write``, which returns once the engine reports the
batch COMPLETED. Since Mooncake 0.3.12 the TCP transport completes a WRITE
only on the target's acknowledgment that the bytes were applied to
destination memory (and the target rejects ranges outside its registered
buffers); RDMA write completion is a reliable-connection completion, i.e.
landed remotely.

Bounded time: the engine's own per-call timeout (``MC_TRANSFER_TIMEOUT``,
read when an engine is created; at least 5 s) is set from the initiator's
``timeout`` unless the environment already sets it. A dead peer fails at once
(connection refused or reset). Log noise: ``MC_LOG_LEVEL`` defaults to WARNING.

Needs Debian's ``libibverbs1`` even for TCP (``engine.so`` links it).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from contextlib import contextmanager
from typing import Any

from kvfence.descriptors import Descriptor, MooncakeDescriptor
from kvfence.transfer.base import (
    DEFAULT_TIMEOUT,
    KVInitiator,
    KVTarget,
    PeerHandle,
    Plan,
    Region,
    TransferError,
    remaining,
)

# Entries per engine batch: its TCP transport queues at most 1024 transfers per peer (plus 1024 waiting
# admission for 1 s) and rejects the rest, so a many-page write goes as several batches, one after another.
MAX_BATCH = 256
MIN_VERSION = (0, 3, 12)  # acknowledged TCP writes: COMPLETED means applied at the destination
_env_lock = threading.Lock()


def probe() -> tuple[bool, str]:
    """Importable, and new enough that a completed TCP write means landed."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return False, (
            f"cannot import mooncake.engine ({e}); install it with "
            "`pip install mooncake-transfer-engine-non-cuda` and `apt-get install libibverbs1`"
        )
    version = _installed_version()
    if version is not None and version < MIN_VERSION:
        return False, f"mooncake {version} is older than {MIN_VERSION}: its TCP writes complete before landing"
    return True, ""


@functools.cache
def _installed_version() -> tuple[int, ...] | None:
    from importlib import metadata

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            release = metadata.version(dist).split(".post")[0]
            return tuple(int(x) for x in release.split(".")[:3])
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return None


@contextmanager
def _env(**values: str):
    """Set environment variables that are not already set, for the duration of the block."""
    with _env_lock:
        added = [k for k in values if k not in os.environ]
        for k in added:
            os.environ[k] = values[k]
        try:
            yield
        finally:
            for k in added:
                del os.environ[k]


def _engine(hostname: str, protocol: str, device: str, timeout: float) -> Any:
    """A started ``TransferEngine`` on ``hostname`` (its RPC port picked by the engine)."""
    from mooncake.engine import TransferEngine

    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    with _env(MC_TRANSFER_TIMEOUT=str(max(5, math.ceil(timeout)))):
        engine = TransferEngine()
    if engine.initialize(hostname, "P2PHANDSHAKE", protocol, device) != 0:
        raise TransferError(f"mooncake engine failed to start on {hostname} with protocol {protocol!r}")
    return engine


def _register(engine: Any, region: Region) -> None:
    if engine.register_memory(region.address, region.nbytes) != 0:
        raise TransferError(f"mooncake could not register {region.nbytes} bytes")


class Target(KVTarget):
    """Options: ``hostname`` (address peers reach, default 127.0.0.1), ``protocol`` ("tcp" | "rdma"),
    ``device`` (RDMA NIC filter, "" = all)."""

    kind = "mooncake"

    def __init__(
        self,
        nbytes: int,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.region = Region.anonymous(nbytes)
        self.buffer = self.region.buffer
        self.nbytes = nbytes
        self.protocol = protocol
        self._engine = _engine(hostname, protocol, device, timeout)
        _register(self._engine, self.region)
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"

    def descriptor(self) -> MooncakeDescriptor:
        return MooncakeDescriptor(nbytes=self.nbytes, session=self.session, protocol=self.protocol,
                                  base=self.region.address)

    def close(self) -> None:
        """Unregister the region (later writes are rejected by the engine) and stop the engine."""
        if self._engine is None:
            return
        self._engine.unregister_memory(self.region.address)
        self._engine = None
        self.region.close()


class MooncakePeer(PeerHandle):
    def __init__(self, descriptor: MooncakeDescriptor) -> None:
        super().__init__(descriptor)
        self.session = descriptor.session
        self.base = descriptor.base


class Initiator(KVInitiator):
    """Options as for ``Target``, plus ``timeout`` (seconds per write)."""

    kind = "mooncake"

    def __init__(
        self,
        nbytes: int,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(nbytes, timeout)
        self.protocol = protocol
        self._engine = _engine(hostname, protocol, device, timeout)
        _register(self._engine, self.region)

    def _connect(self, descriptor: Descriptor) -> PeerHandle:
        assert isinstance(descriptor, MooncakeDescriptor)  # connect checked the kind
        if descriptor.protocol != self.protocol:
            raise TransferError(f"mooncake target speaks {descriptor.protocol!r}, this initiator {self.protocol!r}")
        peer = MooncakePeer(descriptor)
        rc = self._engine.send_probe(peer.session)
        if rc != 0:
            raise TransferError(f"mooncake target {peer.session} unreachable (probe returned {rc})")
        return peer

    def _write(self, peer: PeerHandle, plan: Plan, deadline: float) -> None:
        assert isinstance(peer, MooncakePeer)
        for start in range(0, len(plan), MAX_BATCH):
            remaining(deadline)
            self._write_batch(peer, plan[start : start + MAX_BATCH])

    def _write_batch(self, peer: MooncakePeer, plan: Plan) -> None:
        local, remote = self.region.address, peer.base
        if len(plan) == 1:
            src, dst, n = plan[0]
            rc = self._engine.transfer_sync_write(peer.session, local + src, remote + dst, n)
        else:
            rc = self._engine.batch_transfer_sync_write(
                peer.session, [local + s for s, _, _ in plan], [remote + d for _, d, _ in plan], [n for *_, n in plan]
            )
        if rc != 0:
            raise TransferError(
                f"mooncake write to {peer.session} failed (rc {rc}): target gone, timed out or rejected the range"
            )

    def _release(self) -> None:
        self._engine.unregister_memory(self.region.address)
        self._engine = None
