"""``WorkerSettings``: what a worker process needs to start. Torch-free, so the supervisor (in the router's
process) can build and pickle them without importing the worker code."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from kvfence.cluster import ClusterKey, is_loopback, tcp_host
from kvfence.config import EngineConfig, Timeouts


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker process needs to start (picklable: it crosses the process spawn)."""

    bind: str  # ZeroMQ address to bind the inbox to (its id unless ``advertise`` is set)
    router: str  # the router's inbox address
    model: str
    dtype: str
    device: str
    engine: EngineConfig  # the worker's limits (its ``role`` is this worker's)
    transfer: str = "shm"
    advertise: str | None = None
    emulate_incident: bool = False
    threads: int = 0  # CPU threads (0: torch's default)
    solo_threads: int = 0  # decode: threads while no prefill works for it, pausing between steps while one does
    log_level: str = "INFO"
    handoff_timeout: float = 30.0  # a handoff (pages granted -> Done) may go this long without progress
    cluster_key: ClusterKey | None = None  # membership (cluster.py); crosses the spawn in the pickle, never on disk

    @property
    def role(self) -> str:
        """"prefill" or "decode"."""
        return self.engine.role

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts(self.handoff_timeout)

    def data_plane_options(self, side: str) -> dict:
        """Options for this worker's transfer backend (``side``: "target" on decode, "initiator" on prefill).

        On one host (loopback or ``ipc://`` control addresses) the backends' loopback defaults serve. A worker
        bound elsewhere serves peers on other hosts: tcp's target then listens on the ``--bind`` host and is
        dialled at the ``--advertise`` host, and Mooncake's engine runs on the advertised host. shm needs one
        host and NIXL's UCX finds the interfaces itself. With a cluster key, tcp gets the data-plane secret: its
        connections then authenticate both ends before a byte lands, and encrypt KV beyond loopback.
        """
        return {**self._placement(side), **self._membership()}

    def _placement(self, side: str) -> dict:
        bind = tcp_host(self.bind)
        if bind is None or is_loopback(bind):
            return {}
        public = tcp_host(self.advertise) if self.advertise else None
        if public in _WILDCARDS:
            public = None
        if self.transfer == "tcp" and side == "target":
            return {"host": "0.0.0.0" if bind in _WILDCARDS else bind, "advertise": public}
        if self.transfer == "mooncake":
            return {"hostname": public or (socket.gethostname() if bind in _WILDCARDS else bind)}
        return {}

    def data_plane_caveat(self) -> str | None:
        """What this worker's data plane does not fence, for a warning at start (docs/architecture.md)."""
        if self.transfer not in ("mooncake", "nixl"):
            return None
        return (f"{self.transfer} data plane: the engine authenticates no peer and listens on this host's network "
                "interfaces whatever the control addresses, so any process that reaches its ports (and, for nixl, "
                "learns this worker's metadata) could read or write this worker's KV memory. Run it only where a "
                "firewall lets only the cluster's hosts reach them; --transfer tcp authenticates and encrypts")

    def _membership(self) -> dict:
        if self.transfer != "tcp" or self.cluster_key is None:
            return {}
        return {"secret": self.cluster_key.data_plane_secret}


_WILDCARDS = ("*", "0.0.0.0", "::", "")

