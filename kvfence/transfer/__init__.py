"""KV data plane: one-sided writes of prefill KV into a decode worker's pool (see ``base.py``)."""

from kvfence.transfer.base import (
    BACKENDS,
    DEFAULT_TIMEOUT,
    KVInitiator,
    KVTarget,
    PeerHandle,
    Segment,
    SegmentError,
    TransferError,
    TransferTimeout,
    available,
    make_initiator,
    make_target,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "KVInitiator",
    "KVTarget",
    "PeerHandle",
    "Segment",
    "SegmentError",
    "TransferError",
    "TransferTimeout",
    "available",
    "make_initiator",
    "make_target",
]
