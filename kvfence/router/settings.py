"""``RouterSettings``: what the router's engine (``RemoteEngine``) needs to start, parsed once from the command line
(``cli.make_remote_engine``) and frozen."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.cluster import ClusterKey
from kvfence.config import WORKER_TIMEOUT_S, Timeouts
from kvfence.protocol.capacity import DispatchLimits, QueuePolicy
from kvfence.safety import Safety


@dataclass(frozen=True)
class RouterSettings:
    bind: str  # the router's inbox (ZeroMQ); its id unless ``advertise`` is set
    model_name: str  # the name the API serves
    max_context: int  # prompt + output tokens at most (admission, L1)
    safety: Safety = field(default_factory=Safety)
    advertise: str | None = None
    expected_workers: int = 0  # ``start`` waits for this many workers' Hello (``kvfence serve``'s own)
    timeouts: Timeouts = field(default_factory=Timeouts)  # the router's silence timeout is ``timeouts.silence``
    cluster_key: ClusterKey | None = None  # only its holders can join; without one, ``bind`` stays on this host
    policy: QueuePolicy = field(default_factory=QueuePolicy)  # quotas, queue bound and order
    limits: DispatchLimits = field(default_factory=DispatchLimits)  # when a worker has room for one more request
    worker_timeout: float = WORKER_TIMEOUT_S
