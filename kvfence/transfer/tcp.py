"""``tcp``: a plain TCP data plane. The target receives straight into its region and acks each batch.

Wire format (little-endian), per connection::

    initiator -> HELLO  b"KVFH" + target id (16 bytes)     target -> b"KVOK" (or closes: wrong target)
    then per batch:
    initiator -> BATCH  b"KVFB", nsegs u32, payload u64 ; nsegs x (dst u64, nbytes u64) ; payload
    target    -> ACK    b"KVAK", payload u64                 sent only after the whole payload is in place

The target checks every header (magic, segment count, every range inside the
region, the byte total) before reading any payload; a bad one is logged and
the connection dropped without touching the region. The payload is received
with ``recvmsg_into`` directly into memoryview slices of the region: no
intermediate copy. The target id in the hello makes a stale descriptor (a new
target that reused the port) fail instead of writing into the wrong pool.

Initiators keep their connections to a peer for the next write (writes to one
peer take turns, see ``PeerHandle.enter``). A connection that fails is closed.
A batch leaves in one gather send (header, table and payload), so the target
wakes once per batch; the initiator's blocking calls are bounded by kernel
timeouts rather than Python's poll-per-call ones; and the sockets use a
congestion control that does not pace bursts (see ``_unpaced_congestion``).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import socket
import struct
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np

from kvfence.transfer.base import (
    KVInitiator,
    KVTarget,
    PeerHandle,
    Plan,
    Region,
    TransferError,
    TransferTimeout,
    remaining,
)

log = logging.getLogger(__name__)

HELLO = struct.Struct("<4s16s")
OK = b"KVOK"
BATCH = struct.Struct("<4sIQ")
ACK = struct.Struct("<4sQ")
SEG = np.dtype([("dst", "<u8"), ("nbytes", "<u8")])
SEG1 = struct.Struct("<QQ")  # one table entry
BATCH1 = struct.Struct("<4sIQQQ")  # the header of a one-segment batch with its table
MAX_SEGS = 1 << 20  # per batch; larger writes are split into several batches
IOV_MAX = 1024  # Linux's limit on buffers per sendmsg/recvmsg
SOCK_BUF = 4 << 20
_SMALL_TABLE = 64  # segments per batch below which struct beats NumPy
HELLO_TIMEOUT = 10.0  # a connection that says nothing is dropped after this
TIMEVAL = struct.Struct("@ll")  # struct timeval, for the kernel's send/receive bounds
ARM_SLACK = 0.01  # seconds by which a kernel bound may miss the write's deadline before it is re-armed


def probe() -> tuple[bool, str]:
    return True, ""


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and acks are tiny
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    congestion = _unpaced_congestion()
    if congestion is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion)


@functools.cache
def _unpaced_congestion() -> bytes | None:
    """The first of cubic and reno that this process may set on a socket, or None (the system's default stays).

    A KV write is a burst of up to megabytes whose ack the writer awaits. BBR, the default on some hosts, paces
    such bursts once a connection has carried large ones: on loopback a 64 KiB write then took 55 us instead of
    20 us. Unprivileged processes may set only what ``net.ipv4.tcp_allowed_congestion_control`` lists.
    """
    with socket.socket() as probe:
        for name in (b"cubic", b"reno"):
            try:
                probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name)
            except OSError:
                continue
            return name
    return None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes, or ``ConnectionError`` on EOF."""
    data = sock.recv(n, socket.MSG_WAITALL)
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ConnectionError("connection closed by peer")
        data += more
    return data


def _recv_into_all(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view in order from the stream (scatter receive), or ``ConnectionError`` on EOF."""
    if len(views) == 1:
        view = views[0]
        while len(view):
            got = sock.recv_into(view, len(view), socket.MSG_WAITALL)
            if not got:
                raise ConnectionError("connection closed by peer")
            view = view[got:]
        return
    views = list(views)
    i = 0
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("connection closed by peer")
        for v in batch:  # skip the filled views, shrink a partly filled one
            if got >= len(v):
                got -= len(v)
                i += 1
            else:
                views[i] = v[got:]
                break


def _pack_table(plan: Plan) -> bytes:
    """(dst, nbytes) pairs of ``plan`` as the wire table."""
    if len(plan) <= _SMALL_TABLE:
        return b"".join(SEG1.pack(d, n) for _, d, n in plan)
    a = np.array(plan, dtype=np.int64)
    table = np.empty(len(plan), dtype=SEG)
    table["dst"], table["nbytes"] = a[:, 1], a[:, 2]
    return table.tobytes()


def _parse_table(raw: bytes, nsegs: int) -> list[tuple[int, int]]:
    if nsegs <= _SMALL_TABLE:
        return list(SEG1.iter_unpack(raw))
    table = np.frombuffer(raw, dtype=SEG)
    return list(zip(table["dst"].tolist(), table["nbytes"].tolist(), strict=True))


def _ranges_ok(ranges: list[tuple[int, int]], size: int, total: int) -> bool:
    """Every (dst, nbytes) inside ``[0, size)`` and the lengths summing to ``total``."""
    seen = 0
    for d, k in ranges:
        if d > size or k > size - d:
            return False
        seen += k
    return seen == total


class Target(KVTarget):
    """Listens on ``host:port`` and serves each connection in its own thread.

    ``port`` 0 picks a free port (the descriptor says which). ``advertise`` is the
    address peers dial, by default ``host`` (or this host's name for a wildcard bind).
    """

    kind = "tcp"

    def __init__(self, nbytes: int, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None) -> None:
        self.region = Region.anonymous(nbytes)
        self.buffer = self.region.buffer
        self.nbytes = nbytes
        self.id = uuid.uuid4().bytes
        self._listener = socket.create_server((host, port), backlog=64)
        self.port = self._listener.getsockname()[1]
        self.host = advertise or (socket.gethostname() if host in ("", "0.0.0.0", "::") else host)
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        with self._lock:
            self._spawn(self._accept_loop, "kvfence-tcp-accept")

    def descriptor(self) -> dict:
        return {"kind": self.kind, "host": self.host, "port": self.port, "id": self.id.hex(), "nbytes": self.nbytes}

    def close(self) -> None:
        """Stop listening, drop every connection and wait for the receivers: no byte lands after this."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            threads = list(self._threads)  # complete: threads start only under the lock, while open
        for sock in [self._listener, *conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes accept()/recv() in the serving threads
            except OSError:
                pass
        for t in threads:
            t.join(timeout=5)
        self._listener.close()
        self.region.close()

    def _spawn(self, fn, name: str, *args) -> None:
        """Start a serving thread; call with ``_lock`` held."""
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        self._threads = [*(x for x in self._threads if x.is_alive()), t]
        t.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return  # listener shut down
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
                self._spawn(self._serve, f"kvfence-tcp-{addr[1]}", conn, addr)

    def _serve(self, conn: socket.socket, addr) -> None:
        try:
            _tune(conn)
            conn.settimeout(HELLO_TIMEOUT)
            magic, target_id = HELLO.unpack(_recv_exact(conn, HELLO.size))
            conn.settimeout(None)
            if magic != b"KVFH" or target_id != self.id:
                log.warning("tcp target: %s sent a hello for another target or protocol; dropped", addr)
                return
            conn.sendall(OK)
            while self._serve_batch(conn, addr):
                pass
        except OSError:
            pass  # peer went away or we are closing
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_batch(self, conn: socket.socket, addr) -> bool:
        """Receive one batch into the region and ack it; False ends the connection."""
        try:
            head = _recv_exact(conn, BATCH.size + SEG.itemsize)  # header and the first table entry
        except ConnectionError:
            return False  # clean close between batches
        magic, nsegs, total = BATCH.unpack_from(head)
        if magic != b"KVFB" or not 0 < nsegs <= MAX_SEGS:
            log.warning("tcp target: bad batch header from %s (magic %r, %d segments); dropped", addr, magic, nsegs)
            return False
        if nsegs == 1:
            ranges = [SEG1.unpack_from(head, BATCH.size)]
        else:
            ranges = _parse_table(head[BATCH.size :] + _recv_exact(conn, (nsegs - 1) * SEG.itemsize), nsegs)
        if not _ranges_ok(ranges, self.nbytes, total):
            log.warning(
                "tcp target: batch from %s writes outside [0, %d) or misstates its size; dropped", addr, self.nbytes
            )
            return False
        buf = self.buffer
        _recv_into_all(conn, [buf[d : d + k] for d, k in ranges if k])
        conn.sendall(ACK.pack(b"KVAK", total))
        return True


class _Conn:
    """An initiator's connection: a blocking socket whose calls the kernel bounds (``SO_SNDTIMEO``/``SO_RCVTIMEO``).

    A socket with a Python timeout polls before every send and receive; here the bound is armed to the time left
    until the write's deadline (give or take ``ARM_SLACK``) and re-armed only when that moves. A bound that fires
    raises ``BlockingIOError``: the deadline passed."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        self.sock = sock
        self.armed = math.inf  # seconds the kernel allows one blocking call (none set yet: unbounded)

    def arm(self, deadline: float) -> None:
        """Bound each blocking call by the time left until ``deadline``; raises ``TransferTimeout`` if none is."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("transfer timed out")
        if abs(self.armed - left) > ARM_SLACK:
            tv = TIMEVAL.pack(int(left), max(1, int(left % 1 * 1e6)))  # all zero would mean no bound at all
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.armed = left

    def send_all(self, views: list[memoryview | bytes], nbytes: int, deadline: float) -> None:
        """Send every buffer in order (gather send); ``nbytes`` is their total length."""
        self.arm(deadline)
        sent = self.sock.sendmsg(views[:IOV_MAX])
        if sent == nbytes:
            return  # the common case: everything went in one call
        pending = [memoryview(v) for v in views if len(v)]
        i = 0
        while True:
            while sent:  # drop what was sent
                v = pending[i]
                if sent >= len(v):
                    sent -= len(v)
                    i += 1
                else:
                    pending[i] = v[sent:]
                    sent = 0
            if i == len(pending):
                return
            self.arm(deadline)
            sent = self.sock.sendmsg(pending[i : i + IOV_MAX])

    def recv_exact(self, n: int, deadline: float) -> bytes:
        """Exactly ``n`` bytes, or ``ConnectionError`` on EOF."""
        self.arm(deadline)
        data = self.sock.recv(n, socket.MSG_WAITALL)
        while len(data) < n:
            self.arm(deadline)
            more = self.sock.recv(n - len(data), socket.MSG_WAITALL)
            if not more:
                raise ConnectionError("connection closed by peer")
            data += more
        return data


class TcpPeer(PeerHandle):
    def __init__(self, descriptor: dict) -> None:
        super().__init__(descriptor)
        self.address = (descriptor["host"], int(descriptor["port"]))
        self.target_id = bytes.fromhex(descriptor["id"])
        self._idle: collections.deque[_Conn] = collections.deque()  # append and pop are atomic: no lock needed

    def take(self, deadline: float) -> _Conn:
        """An idle connection, or a new one that passed the hello."""
        try:
            return self._idle.pop()
        except IndexError:
            pass
        try:
            sock = socket.create_connection(self.address, timeout=remaining(deadline))
        except OSError as e:
            raise TransferError(f"tcp target {self.address} unreachable: {e}") from e
        try:
            _tune(sock)
            sock.sendall(HELLO.pack(b"KVFH", self.target_id))
            if _recv_exact(sock, len(OK)) != OK:
                raise TransferError(f"tcp target {self.address} answered the hello wrongly")
        except (OSError, TransferError) as e:
            sock.close()
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"tcp target {self.address} refused this descriptor (stale or wrong id): {e}") from e
        return _Conn(sock)

    def give_back(self, conn: _Conn) -> None:
        self._idle.append(conn)

    def close_all(self) -> None:
        while self._idle:
            try:
                self._idle.pop().sock.close()
            except IndexError:
                return


class Initiator(KVInitiator):
    """Streams header + table + payload (gathered from the local region) per batch and waits for the ack."""

    kind = "tcp"

    def _connect(self, descriptor: dict) -> PeerHandle:
        peer = TcpPeer(descriptor)
        peer.give_back(peer.take(time.monotonic() + self.timeout))  # fail now if unreachable or stale
        return peer

    def _write(self, peer: PeerHandle, plan: Plan, deadline: float) -> None:
        assert isinstance(peer, TcpPeer)
        if not len(plan):
            return
        conn = peer.take(deadline)
        try:
            if len(plan) <= MAX_SEGS:
                self._send_batch(conn, plan, deadline)
            else:
                for start in range(0, len(plan), MAX_SEGS):
                    self._send_batch(conn, plan[start : start + MAX_SEGS], deadline)
        except BaseException as e:
            conn.sock.close()
            if isinstance(e, (TimeoutError, BlockingIOError)):  # a Python timeout or a kernel bound fired
                raise TransferTimeout(f"tcp write to {peer.address} timed out") from e
            if isinstance(e, (OSError, ConnectionError)):
                raise TransferError(f"tcp write to {peer.address} failed: {e}") from e
            raise
        peer.give_back(conn)

    def _send_batch(self, conn: _Conn, plan: Plan, deadline: float) -> None:
        buf = self.buffer
        if len(plan) == 1:
            src, dst, total = plan[0]
            head = BATCH1.pack(b"KVFB", 1, total, dst, total)
            payload = [buf[src : src + total]]
        else:
            total = sum(n for _, _, n in plan)
            head = BATCH.pack(b"KVFB", len(plan), total) + _pack_table(plan)
            payload = [buf[s : s + n] for s, _, n in plan]
        conn.send_all([head, *payload], len(head) + total, deadline)
        magic, acked = ACK.unpack(conn.recv_exact(ACK.size, deadline))
        if magic != b"KVAK" or acked != total:
            raise TransferError(f"tcp target acked {acked} of {total} bytes ({magic!r})")

    def _disconnect(self, peer: PeerHandle) -> None:
        assert isinstance(peer, TcpPeer)
        peer.close_all()
