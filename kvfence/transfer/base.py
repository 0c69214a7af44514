"""The KV data plane: one-sided writes from a prefill region into a decode region.

A decode worker owns a ``KVTarget``: one page-aligned byte region (its KV pool)
that peers may write into, described by its ``descriptor()`` (``kvfence/descriptors.py``). A prefill
worker owns a ``KVInitiator``: its own page-aligned region (its prefill pool),
from which it copies byte ranges into a target's region, the way an RDMA write
would. Control messages (``Dest``, ``Done`` ...) never travel here.

Contracts every backend keeps (``tests/test_transfer.py`` checks them all):

- ``write`` returns only once every byte has landed in the target's memory, so
  a ``Done`` sent after it never overtakes the data. It raises ``TransferError``
  if the target dies, closes or rejects the write, and ``TransferTimeout`` (a
  ``TransferError``) once ``timeout`` passes without completion (Mooncake's
  engine enforces its own timeout, 5 s at least). Writing into a stopped but
  live target's memory succeeds on shm and nixl: the bytes did land.
- After a ``TransferError`` the write may have landed partly, and on network
  backends bytes still in flight may land later: the caller must treat every
  destination byte of that write as possibly written (quarantine, section 4 I2).
- A segment outside either region raises ``SegmentError`` before anything is
  sent; network targets check again on their side.
- Writes ``submit``-ted to one peer run one at a time in submission order; a
  ``write`` on a peer first waits for that peer's earlier submissions. Writes
  to one peer from different threads take turns; writes to different peers
  may run concurrently.
- After a transport failure a ``PeerHandle`` is poisoned: every later write on
  it fails fast. ``connect`` with the same descriptor builds a fresh one.
- Regions are never unmapped under a live view: ``torch.frombuffer`` keeps a
  reference to ``buffer`` but no buffer export, so ``close`` only drops this
  object's references and the kernel mapping goes with the last view.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import importlib
import mmap
import operator
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, NoReturn

import numpy as np

from kvfence.descriptors import Descriptor

Segment = tuple[int, int, int]  # (src_offset, dst_offset, nbytes)
Plan = Sequence[Segment]  # validated, coalesced segments, as handed to a backend (a list or a tuple)
BACKENDS = ("shm", "tcp", "mooncake", "nixl")
DEFAULT_TIMEOUT = 10.0
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; the mmap module of Python 3.11 lacks the name


class TransferError(RuntimeError):
    """A write did not (provably) land: peer gone, timeout, rejected, bad descriptor."""


class SegmentError(TransferError):
    """A segment lies outside the source or the target region, or is malformed."""


class TransferTimeout(TransferError):
    """A write did not complete within its timeout."""


# ---------------------------------------------------------------------------- regions


class Region:
    """A page-aligned writable mapping: ``buffer`` (exactly ``nbytes``) at virtual ``address``.

    The mapping is prefaulted (huge pages where the kernel allows) so the first
    transfer or ``torch.frombuffer`` view does not pay page faults. Contents
    start as whatever the kernel gives (zeros) and are never scrubbed again.
    """

    def __init__(self, mm: mmap.mmap) -> None:
        self._mm: mmap.mmap | None = mm
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(mm)  # a buffer export: pins the mapping
        self.address: int = ctypes.addressof(self._anchor)
        self.buffer: memoryview = memoryview(mm)
        self.nbytes = len(mm)

    @classmethod
    def anonymous(cls, nbytes: int) -> Region:
        """Private anonymous memory of ``nbytes`` (> 0), transparent huge pages requested."""
        if nbytes <= 0:
            raise ValueError(f"region size must be positive, got {nbytes}")
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
        prefault(mm)
        return cls(mm)

    def close(self) -> None:
        """Drop this object's references; the mapping itself outlives any view still using it."""
        self._anchor = None
        self.buffer = None  # type: ignore[assignment]
        self._mm = None


def prefault(mm: mmap.mmap) -> None:
    """Back every page of ``mm`` now, writing to none of its bytes' values."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):  # old kernel: touch one byte per page, keeping its value
        pages = np.frombuffer(mm, dtype=np.uint8)[:: mmap.PAGESIZE]
        pages[:] = pages
        del pages


# ---------------------------------------------------------------------------- segments


def plan_segments(segments: Sequence[Segment] | np.ndarray, src_size: int, dst_size: int) -> Plan:
    """Validate ``segments`` against both regions and coalesce runs into a ``Plan``.

    Raises ``SegmentError`` for a malformed segment or one outside ``[0, src_size)`` /
    ``[0, dst_size)``. Zero-length segments are dropped. Consecutive segments that
    continue each other in both regions merge into one; order is otherwise kept,
    so overlapping destinations keep their last-writer-wins order.
    """
    if isinstance(segments, (list, tuple)) and len(segments) <= _SMALL_PLAN:
        return _plan_small(segments, src_size, dst_size)
    return [tuple(row) for row in _plan_large(segments, src_size, dst_size).tolist()]


_SMALL_PLAN = 16  # below this many segments plain Python beats NumPy's per-call overhead


def _plan_small(segments: Sequence[Segment], src_size: int, dst_size: int) -> Plan:
    plan: list[Segment] = []
    try:
        for src, dst, n in segments:
            if not type(src) is type(dst) is type(n) is int:  # NumPy integers and the like
                src, dst, n = operator.index(src), operator.index(dst), operator.index(n)
            if n < 0 or src < 0 or dst < 0 or src + n > src_size or dst + n > dst_size:
                _raise_for_first_bad(segments, src_size, dst_size)
            if n == 0:
                continue
            if plan:
                s0, d0, n0 = plan[-1]
                if s0 + n0 == src and d0 + n0 == dst:
                    plan[-1] = (s0, d0, n0 + n)
                    continue
            plan.append((src, dst, n))
    except (TypeError, ValueError):  # not a triple of integers
        _raise_for_first_bad(segments, src_size, dst_size)
    return plan


def _raise_for_first_bad(segments: Sequence[Segment], src_size: int, dst_size: int) -> NoReturn:
    """Raise ``SegmentError`` naming the first malformed or out-of-range segment."""
    for i, seg in enumerate(segments):
        try:
            src, dst, n = seg
            src, dst, n = operator.index(src), operator.index(dst), operator.index(n)
        except (TypeError, ValueError) as e:
            raise SegmentError(f"segment {i} {seg!r} is not a (src, dst, nbytes) integer triple: {e}") from None
        if n < 0 or src < 0 or dst < 0 or src + n > src_size or dst + n > dst_size:
            raise SegmentError(
                f"segment {i} {(src, dst, n)} is outside the source [0, {src_size}) or the target [0, {dst_size})"
            )
    raise AssertionError("no bad segment found")


def _plan_large(segments: Sequence[Segment] | np.ndarray, src_size: int, dst_size: int) -> np.ndarray:
    try:
        a = np.asarray(segments)
        if a.size and a.dtype.kind not in "iu":  # floats would truncate; objects are ints beyond 64 bits
            raise TypeError(f"got {a.dtype} values")
        a = a.astype(np.int64).reshape(-1, 3)  # uint64 beyond int64 wraps negative: rejected below
    except (ValueError, TypeError) as e:
        raise SegmentError(f"segments must be (src, dst, nbytes) integer triples: {e}") from None
    src, dst, n = a[:, 0], a[:, 1], a[:, 2]
    # Compare against size - offset so that no sum can overflow int64.
    bad = (n < 0) | (src < 0) | (dst < 0) | (src > src_size) | (dst > dst_size)
    bad |= (n > src_size - src) | (n > dst_size - dst)
    if bad.any():
        i = int(np.argmax(bad))
        raise SegmentError(
            f"segment {i} {tuple(int(x) for x in a[i])} is outside the source [0, {src_size}) "
            f"or the target [0, {dst_size})"
        )
    a = a[n > 0]
    if len(a) < 2:
        return a
    brk = np.ones(len(a), dtype=bool)
    brk[1:] = (a[1:, 0] != a[:-1, 0] + a[:-1, 2]) | (a[1:, 1] != a[:-1, 1] + a[:-1, 2])
    starts = np.flatnonzero(brk)
    if len(starts) == len(a):
        return a
    return np.column_stack((a[starts, 0], a[starts, 1], np.add.reduceat(a[:, 2], starts)))


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (monotonic); raises ``TransferTimeout`` when none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout("transfer timed out")
    return left


# ---------------------------------------------------------------------------- target


class KVTarget(ABC):
    """Decode side: owns a registered region of ``nbytes`` that peers may write into.

    ``buffer`` is writable, exactly ``nbytes`` long, page-aligned, and stays valid
    until ``close()`` (and beyond, for views built on it before). After ``close``
    returns, no peer write lands any more, except with nixl, whose close reaches
    connected initiators asynchronously (see ``nixl.py``); a target process's exit
    stops every backend.
    """

    kind: ClassVar[str]
    buffer: memoryview
    nbytes: int

    @abstractmethod
    def descriptor(self) -> Descriptor:
        """Everything an initiator needs to connect; its ``kind`` is this backend's."""

    @abstractmethod
    def close(self) -> None:
        """Stop accepting writes and release what this target registered. Idempotent."""

    def __enter__(self) -> KVTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- initiator


class PeerHandle:
    """One connected target as an initiator sees it. Made by ``KVInitiator.connect``; thread-safe."""

    def __init__(self, descriptor: Descriptor) -> None:
        self.descriptor = descriptor
        self.nbytes = descriptor.nbytes
        self.failure: TransferError | None = None
        self._lock = threading.Lock()
        self._queue: cf.ThreadPoolExecutor | None = None
        self._tail: cf.Future | None = None
        self._gate = threading.Lock()  # held by the write running on this peer; teardown takes it after that write
        self.exit = self._gate.release  # ends a write that ``enter`` started
        self._closed = False

    def poison(self, error: TransferError) -> None:
        if self.failure is None:
            self.failure = error

    def enqueue(self, job: Callable[[], None]) -> cf.Future:
        """Run ``job`` after every job enqueued before it on this peer."""
        with self._lock:
            if self._queue is None:
                self._queue = cf.ThreadPoolExecutor(1, thread_name_prefix="kvfence-xfer")
            self._tail = self._queue.submit(job)
            return self._tail

    def idle(self) -> bool:
        """Whether every job enqueued so far has finished."""
        tail = self._tail
        return tail is None or tail.done()

    def wait_idle(self, deadline: float) -> None:
        """Wait until every job enqueued so far has finished (its outcome is not raised here)."""
        tail = self._tail
        if tail is not None and not tail.done():
            done, _ = cf.wait([tail], timeout=remaining(deadline))
            if not done:
                raise TransferTimeout("timed out waiting for earlier submitted writes to this peer")

    def enter(self, deadline: float) -> None:
        """Start a write: wait (until ``deadline``) for the one running on this peer, if any. Refuse once an
        earlier transport failure poisoned the peer (before waiting, too) or once it is closing, so teardown never
        races a write. One write per peer at a time; ``exit()`` ends it."""
        if self.failure is None and (self._gate.acquire(False) or self._gate.acquire(True, remaining(deadline))):
            if self.failure is None and not self._closed:
                return
            self._gate.release()
        if self.failure is not None:
            raise TransferError(f"peer unusable after an earlier failure: {self.failure}") from self.failure
        if self._closed:
            raise TransferError("peer closed")
        raise TransferTimeout("timed out waiting for another write to this peer")

    def shutdown(self) -> None:
        """Refuse new writes, cancel queued ones, and wait for the running one (bounded by its timeout)."""
        self._closed = True
        if self._queue is not None:
            self._queue.shutdown(wait=True, cancel_futures=True)
        with self._gate:
            pass


class KVInitiator(ABC):
    """Prefill side: owns a local region (``buffer``, ``nbytes``) and writes ranges of it into targets.

    Subclasses implement ``_connect`` / ``_write`` / ``_disconnect``; this class adds
    validation, the peer cache, ordering, deadlines and poisoning.
    """

    kind: ClassVar[str]

    def __init__(self, nbytes: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.region = Region.anonymous(nbytes)
        self.buffer: memoryview = self.region.buffer
        self.nbytes = nbytes
        self.timeout = timeout
        self._peers: dict[Descriptor, PeerHandle] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- backend hooks

    @abstractmethod
    def _connect(self, descriptor: Descriptor) -> PeerHandle:
        """Open a peer for ``descriptor`` (of this backend's kind); raise ``TransferError`` if it is unreachable."""

    @abstractmethod
    def _write(self, peer: PeerHandle, plan: Plan, deadline: float) -> None:
        """Move validated ``plan`` rows (src, dst, nbytes); return once all landed, else raise."""

    def _disconnect(self, peer: PeerHandle) -> None:  # noqa: B027 (optional hook)
        """Release what ``_connect`` acquired (called once no write runs on ``peer``)."""

    def _release(self) -> None:  # noqa: B027 (optional hook)
        """Release what the backend registered for the local region (called last by ``close``)."""

    def _trim(self, peer: PeerHandle) -> None:  # noqa: B027 (optional hook)
        """Unmap the pages of ``peer``'s memory this process has touched, where the backend maps it (``trim``)."""

    # -- public API

    def connect(self, descriptor: Descriptor) -> PeerHandle:
        """The peer for ``descriptor``, cached; a poisoned peer is replaced by a fresh connection."""
        if descriptor.kind != self.kind:
            raise TransferError(f"{self.kind} initiator cannot use a {descriptor.kind!r} descriptor")
        with self._lock:
            self._check_open()
            peer = self._peers.get(descriptor)
            if peer is not None and peer.failure is None:
                return peer
            if peer is not None:
                self._drop(descriptor, peer)
            peer = self._connect(descriptor)
            self._peers[descriptor] = peer
            return peer

    def write(self, peer: PeerHandle, segments: Sequence[Segment], timeout: float | None = None) -> None:
        """Copy ``segments`` into ``peer``; return once every byte has landed there.

        Waits first for writes submitted earlier to ``peer``. Raises ``SegmentError``
        (nothing sent) or ``TransferError`` / ``TransferTimeout`` within ``timeout``.
        """
        plan = plan_segments(segments, self.nbytes, peer.nbytes)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        peer.wait_idle(deadline)
        self._run(peer, plan, deadline)

    def submit(self, peer: PeerHandle, segments: Sequence[Segment], timeout: float | None = None) -> cf.Future:
        """Like ``write`` but asynchronous: the future resolves once the bytes landed.

        Segments are validated now (``SegmentError`` raised here); ``timeout`` counts
        from when the write starts. Writes submitted to one peer land in order.
        """
        plan = plan_segments(segments, self.nbytes, peer.nbytes)
        limit = self.timeout if timeout is None else timeout
        self._check_open()
        return peer.enqueue(lambda: self._run(peer, plan, time.monotonic() + limit))

    def trim(self) -> None:
        """Let go of the pages of peers' memory mapped into this process (shm), for an idle worker: RSS would
        otherwise count a decode pool in both processes that map it. Nothing is lost: the next write maps the
        pages back (minor faults); safe beside a running write."""
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            self._trim(peer)

    def close(self) -> None:
        """Finish or cancel pending writes, disconnect every peer, release the local region. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for key, peer in list(self._peers.items()):
                self._drop(key, peer)
        self._release()
        self.region.close()

    def __enter__(self) -> KVInitiator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals

    def _run(self, peer: PeerHandle, plan: Plan, deadline: float) -> None:
        peer.enter(deadline)
        try:
            self._write(peer, plan, deadline)
        except SegmentError:  # the caller's mistake, not the peer's
            raise
        except TransferError as e:
            peer.poison(e)
            raise
        except OSError as e:
            err = TransferError(f"{self.kind} write failed: {e}")
            peer.poison(err)
            raise err from e
        finally:
            peer.exit()

    def _drop(self, key: Descriptor, peer: PeerHandle) -> None:
        del self._peers[key]
        peer.poison(TransferError("peer closed"))
        peer.shutdown()
        self._disconnect(peer)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("initiator is closed")


# ---------------------------------------------------------------------------- registry


def _backend(kind: str):
    if kind not in BACKENDS:
        raise ValueError(f"unknown transfer backend {kind!r}; choose one of {BACKENDS}")
    return importlib.import_module(f"kvfence.transfer.{kind}")


def available(kind: str) -> tuple[bool, str]:
    """Whether backend ``kind`` can load here, and if not why (with the install hint)."""
    return _backend(kind).probe()


def _require(kind: str):
    module = _backend(kind)
    ok, why = module.probe()
    if not ok:
        raise TransferError(f"transfer backend {kind!r} is unavailable: {why}")
    return module


def make_target(kind: str, nbytes: int, **opts) -> KVTarget:
    """A target of backend ``kind`` owning ``nbytes``; ``opts`` go to the backend (see its module)."""
    return _require(kind).Target(nbytes, **opts)


def make_initiator(kind: str, nbytes: int, **opts) -> KVInitiator:
    """An initiator of backend ``kind`` with a local region of ``nbytes``; ``opts`` include ``timeout``."""
    return _require(kind).Initiator(nbytes, **opts)
