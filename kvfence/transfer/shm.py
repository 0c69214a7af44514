"""``shm``: the one-host default. The target's region is a POSIX shared-memory file; initiators map it and memcpy.

Liveness: the target holds an exclusive open-file-description lock (``F_OFD_SETLK``)
on its file for its whole life; the kernel drops it when the target closes or
dies, ``kill -9`` included. After each copy an initiator asks (one
``F_OFD_GETLK``) whether the lock is still held; if not, the target closed or
died, and the write raises ``TransferError`` even though the bytes reached the
(orphaned) mapping.
A crashed target's file is unlinked by the first initiator that notices and by
the next ``Target`` created in the same directory (its lock is free), so
``kill -9`` leaks nothing for long. Nothing goes through ``multiprocessing``'s
resource tracker.

Caveat: a child ``fork``-ed (without exec) from the target inherits the lock
descriptor and keeps the target looking alive until it exits.

Who may map a segment: it is created ``O_EXCL`` with mode exactly 0600, so
only its owner (and root) can open it; shm is a one-host data plane and the
cluster's processes run as one user. The directory is world-writable, so an
initiator maps only a regular file (no symlink) that this user owns and no
one else may open: a file planted under a dead target's name is refused, and
KV never lands in another user's file. The sweep likewise ignores files it
does not own, so no other user can stop a target from starting.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import logging
import mmap
import os
import stat
import struct
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from kvfence import env
from kvfence.cbuild import load_extension
from kvfence.descriptors import Descriptor, ShmDescriptor
from kvfence.transfer.base import (
    DEFAULT_TIMEOUT,
    KVInitiator,
    KVTarget,
    PeerHandle,
    Plan,
    Region,
    Segment,
    TransferError,
    plan_segments,
)

log = logging.getLogger(__name__)
DEFAULT_DIR = "/dev/shm"
PREFIX = "kvfence-kv-"


def probe() -> tuple[bool, str]:
    """shm needs a writable tmpfs directory (``/dev/shm`` by default)."""
    if not os.access(DEFAULT_DIR, os.W_OK):
        return False, f"{DEFAULT_DIR} is not writable (pass dir=... to make_target)"
    return True, ""


_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid
_WHOLE_FILE = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
_UNLOCKED = struct.pack("h", fcntl.F_UNLCK)  # l_type, the first field of the answer


def _lock(fd: int) -> bool:
    """Take a whole-file write lock owned by ``fd``'s open file description; False if someone holds one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _WHOLE_FILE)
    except (BlockingIOError, PermissionError):
        return False
    return True


def _locked(fd: int) -> bool:
    """Whether some other open file description holds a lock on the file (one syscall, no exception)."""
    return fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _WHOLE_FILE)[:2] != _UNLOCKED


def _open_own(path: str | Path) -> int:
    """Open ``path`` read-write if it is a regular file (not a symlink) of this user that no one else may open;
    ``OSError`` (``PermissionError`` for a file that fails the checks) otherwise."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"{path} is not a private segment of this user (owner {st.st_uid}, mode "
                              f"{st.st_mode & 0o7777:04o})")
    return fd


def sweep_stale(directory: str, unlink: bool = True) -> list[Path]:
    """Unlink this user's segments in ``directory`` whose owner is gone (no one holds their lock); returns them
    (``unlink`` False: only lists them). Files of other users, or that it cannot remove, are left alone."""
    swept = []
    for path in Path(directory).glob(f"{PREFIX}*"):
        if path.name.endswith(".tmp"):
            continue
        try:
            fd = _open_own(path)
        except OSError:
            continue
        try:
            if _lock(fd):
                if unlink:
                    path.unlink(missing_ok=True)
                    log.warning("shm: removed stale KV segment %s (its target died)", path)
                swept.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return swept


class Target(KVTarget):
    """A KV region in ``dir``/kvfence-kv-<uuid>, reserved up front (no SIGBUS later) and prefaulted."""

    kind = "shm"

    def __init__(self, nbytes: int, dir: str = DEFAULT_DIR) -> None:
        if nbytes <= 0:
            raise ValueError(f"region size must be positive, got {nbytes}")
        sweep_stale(dir)
        self.nbytes = nbytes
        self.path = os.path.join(dir, f"{PREFIX}{uuid.uuid4().hex}")
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        lock_fd = -1
        try:
            os.fchmod(fd, 0o600)  # exactly: a umask may only have narrowed it, which would lock out the initiators
            # The lock lives on its own open file: mmap dups the mapping fd, which would keep
            # a lock taken on it held for as long as any view of the region lives.
            lock_fd = os.open(tmp, os.O_RDWR)
            if not _lock(lock_fd):  # taken before the name is visible: never seen unlocked while alive
                raise OSError(f"cannot lock {tmp}")
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now rather than SIGBUS on first write
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            os.rename(tmp, self.path)
        except BaseException:
            if lock_fd >= 0:
                os.close(lock_fd)
            Path(tmp).unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._lock_fd: int | None = lock_fd
        self.region = Region(mm)
        self.buffer = self.region.buffer

    def descriptor(self) -> ShmDescriptor:
        return ShmDescriptor(nbytes=self.nbytes, path=self.path, pid=os.getpid())

    def close(self) -> None:
        """Unlink the name and drop the lock: initiators' later writes fail. Views stay valid."""
        if self._lock_fd is None:
            return
        Path(self.path).unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None
        self.region.close()


class ShmPeer(PeerHandle):
    def __init__(self, descriptor: ShmDescriptor, fd: int, mm: mmap.mmap) -> None:
        super().__init__(descriptor)
        self.path, self.pid = descriptor.path, descriptor.pid
        self.fd = fd
        self.mm = mm
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(mm)
        self.address = ctypes.addressof(self._anchor)

    def ensure_alive(self) -> None:
        """Raise ``TransferError`` unless the target still holds its lock."""
        if not _locked(self.fd):
            self.gone()

    def gone(self) -> NoReturn:
        """The target's lock is free: it closed or died. Raises ``TransferError``."""
        Path(self.path).unlink(missing_ok=True)  # a dead target cannot clean up after itself
        raise TransferError(f"shm target {self.path} (pid {self.pid}) closed or died")

    def unmap(self) -> None:
        self._anchor = None
        self.mm.close()
        os.close(self.fd)


@functools.cache
def _c_copy() -> ModuleType | None:
    """``shm_copy.c`` built as a Python module (checks, copies and the lock query in one call), or None where it
    cannot be built here or ``KVFENCE_SHM_C=0``: then the writes take the Python path, the same bytes slower."""
    if not env.shm_c():
        return None
    return load_extension(Path(__file__).with_name("shm_copy.c"), "_kvf_shm_copy")


class Initiator(KVInitiator):
    """Copies straight into the target's pages: one call into ``shm_copy.c`` per write (segments checked, copied
    in order, then the liveness query), or where that is not built one ``memmove`` per coalesced segment."""

    kind = "shm"

    def __init__(self, nbytes: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(nbytes, timeout)
        c_copy = _c_copy()
        self._copy = None if c_copy is None else c_copy.copy

    def write(self, peer: PeerHandle, segments: Sequence[Segment], timeout: float | None = None) -> None:
        """As ``KVInitiator.write``. With nothing submitted to ``peer`` still pending and the C copy built, the
        segments go to it unplanned (it checks them as ``plan_segments`` does and copies nothing if one fails):
        a 64 KiB write then costs ~0.45 us more than a bare memcpy instead of ~1.8 us."""
        if self._copy is None or type(segments) not in (list, tuple) or not peer.idle():
            return super().write(peer, segments, timeout)
        self._run(peer, segments, time.monotonic() + (self.timeout if timeout is None else timeout))

    def _connect(self, descriptor: Descriptor) -> PeerHandle:
        assert isinstance(descriptor, ShmDescriptor)  # connect checked the kind
        path, nbytes = descriptor.path, descriptor.nbytes
        try:
            fd = _open_own(path)
        except FileNotFoundError:
            raise TransferError(f"shm target {path} not found: it closed, died, or lives on another host") from None
        except OSError as e:
            raise TransferError(f"shm target {path} refused: {e}") from None
        try:
            if os.fstat(fd).st_size < nbytes:
                raise TransferError(f"shm target {path} is smaller than its descriptor says")
            # Not populated: only the pages this process writes count in its RSS (until ``trim``), not the whole
            # pool that the target's RSS already holds.
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        peer = ShmPeer(descriptor, fd, mm)
        try:
            peer.ensure_alive()
        except TransferError:
            peer.unmap()
            raise
        return peer

    def _write(self, peer: PeerHandle, plan: Plan, deadline: float) -> None:
        assert isinstance(peer, ShmPeer)
        if self._copy is None:
            src_base, dst_base = self.region.address, peer.address
            for src, dst, n in plan:
                ctypes.memmove(dst_base + dst, src_base + src, n)
            peer.ensure_alive()  # the copy landed in a mapping the target still owns
            return
        alive = self._copy(peer.address, self.region.address, plan, self.nbytes, peer.nbytes, peer.fd)
        if alive < 0:  # a segment failed the checks; nothing was copied
            plan_segments(plan, self.nbytes, peer.nbytes)  # raises SegmentError, with its message
            raise AssertionError("shm_copy.c refused segments that plan_segments accepts")
        if not alive:
            peer.gone()

    def _trim(self, peer: PeerHandle) -> None:
        assert isinstance(peer, ShmPeer)
        peer.mm.madvise(mmap.MADV_DONTNEED)  # a shared file mapping: the pages stay in the file, only unmapped here

    def _disconnect(self, peer: PeerHandle) -> None:
        assert isinstance(peer, ShmPeer)
        peer.unmap()
