"""``tcp``: a plain TCP data plane. The target receives straight into its region and acks each batch.

Wire format (little-endian), per connection::

    initiator -> HELLO  b"KVFH" + target id (16 bytes)     target -> b"KVOK" (or closes: wrong target)
                 (with a cluster key: the mutual challenge-response of ``tcp_auth.py`` instead)
    then per batch:
    initiator -> BATCH  b"KVFB", nsegs u32, payload u64 ; nsegs x (dst u64, nbytes u64) ; payload
    target    -> ACK    b"KVAK", payload u64                 sent only after the whole payload is in place

The target checks every header (magic, segment count, every range inside the
region, the byte total) before reading any payload; a bad one is logged and
the connection dropped without touching the region. The payload is received
with ``recvmsg_into`` directly into memoryview slices of the region: no
intermediate copy. The target id in the hello makes a stale descriptor (a new
target that reused the port) fail instead of writing into the wrong pool.

Membership (``tcp_auth.py``). With the cluster's data-plane secret (option
``secret``), both ends prove they hold it before the target reads a batch:
a connection that does not is logged (throttled) and dropped, having landed
nothing. A target whose listener is not on loopback also seals the
connection (AES-256-GCM records, verified before they land; option
``sealed``): KV bytes are the prompt in another form. Without a secret a
target listens on loopback only, as in single-host development.

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

from kvfence.cluster import Throttle, is_loopback
from kvfence.descriptors import Descriptor, TcpDescriptor
from kvfence.transfer import tcp_auth
from kvfence.transfer.base import (
    DEFAULT_TIMEOUT,
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
SEALED_HEAD = struct.Struct("<I")  # a sealed batch header's plaintext length, before its record
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
SCRATCH = 2 * (tcp_auth.RECORD + tcp_auth.TAG)  # a sealed connection's buffer: a full record always fits


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
    ``secret``: the cluster's data-plane secret; only initiators holding it may write,
    and without it ``host`` must be loopback (``ValueError``). ``sealed``: encrypt each
    connection (default: when ``host`` is not loopback; needs ``secret``).
    """

    kind = "tcp"

    def __init__(self, nbytes: int, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 secret: bytes | None = None, sealed: bool | None = None) -> None:
        local = is_loopback(host)
        if secret is None and (not local or sealed):
            raise ValueError(f"a tcp data plane on {host!r} (not loopback) or sealed needs the cluster key (secret)")
        self.keys = tcp_auth.MemberKeys(secret) if secret is not None else None
        self.sealed = (not local) if sealed is None else sealed
        self.refusals = Throttle(log)
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

    def descriptor(self) -> TcpDescriptor:
        return TcpDescriptor(nbytes=self.nbytes, host=self.host, port=self.port, id=self.id.hex(),
                             members_only=self.keys is not None)

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
            seal = self._admit(conn)
            conn.settimeout(None)
            conn.sendall(OK)
            if seal is None:
                while self._serve_batch(conn, addr):
                    pass
            else:
                scratch = memoryview(bytearray(SCRATCH))
                while self._serve_sealed_batch(conn, addr, seal, scratch):
                    pass
        except tcp_auth.Refused as e:
            self.refusals.warn("refused", "tcp target: refused a connection from %s: %s", addr, e)
        except OSError:
            pass  # peer went away or we are closing
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _admit(self, conn: socket.socket) -> tcp_auth.Seal | None:
        """Read the hello; with a secret, run the challenge-response. Returns the connection's seal (None: plain
        batches follow); raises ``Refused`` (or ``OSError``) having read nothing beyond the hello."""
        magic = _recv_exact(conn, 4)
        if self.keys is None:
            if magic != b"KVFH":
                raise tcp_auth.Refused(f"it sent {magic!r}, not a hello (a cluster member talking to a target "
                                       "without a cluster key?)")
            if _recv_exact(conn, HELLO.size - 4) != self.id:
                raise tcp_auth.Refused("its hello names another target (a stale descriptor)")
            return None
        if magic != b"KVFM":
            raise tcp_auth.Refused("it did not authenticate (no cluster key?)")
        target_id, nonce_i = tcp_auth.MEMBER_HELLO.unpack(magic + _recv_exact(conn, tcp_auth.MEMBER_HELLO.size - 4))[1:]
        if target_id != self.id:
            raise tcp_auth.Refused("its hello names another target (a stale descriptor)")
        nonce_t = tcp_auth.nonce()
        transcript = tcp_auth.transcript(self.id, nonce_i, nonce_t, self.sealed)
        conn.sendall(tcp_auth.CHALLENGE.pack(b"KVFC", nonce_t, self.sealed, self.keys.proof(b"target", transcript)))
        self.keys.check(b"initiator", transcript, _recv_exact(conn, tcp_auth.PROOF_BYTES))
        return self.keys.session(transcript, initiator=False) if self.sealed else None

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
        if not self._ranges_ok(ranges, total, addr):
            return False
        buf = self.buffer
        _recv_into_all(conn, [buf[d : d + k] for d, k in ranges if k])
        conn.sendall(ACK.pack(b"KVAK", total))
        return True

    def _serve_sealed_batch(self, conn: socket.socket, addr, seal: tcp_auth.Seal, scratch: memoryview) -> bool:
        """As ``_serve_batch`` over sealed records: the header's, then each range's in records of at most
        ``RECORD`` bytes, each landing only once its tag verified."""
        try:
            (size,) = SEALED_HEAD.unpack(_recv_exact(conn, SEALED_HEAD.size))
        except ConnectionError:
            return False
        if not BATCH.size + SEG.itemsize <= size <= BATCH.size + MAX_SEGS * SEG.itemsize:
            log.warning("tcp target: bad sealed batch header from %s (%d bytes); dropped", addr, size)
            return False
        head = seal.open(_recv_exact(conn, size + tcp_auth.TAG))
        magic, nsegs, total = BATCH.unpack_from(head)
        if magic != b"KVFB" or not 0 < nsegs <= MAX_SEGS or size != BATCH.size + nsegs * SEG.itemsize:
            log.warning("tcp target: bad batch header from %s (magic %r, %d segments); dropped", addr, magic, nsegs)
            return False
        ranges = _parse_table(head[BATCH.size :], nsegs)
        if not self._ranges_ok(ranges, total, addr):
            return False
        buf, cipher, plain = self.buffer, scratch[: len(scratch) // 2], scratch[len(scratch) // 2 :]
        for d, k in ranges:
            for off in range(0, k, tcp_auth.RECORD):
                n = min(tcp_auth.RECORD, k - off)
                _recv_into_all(conn, [cipher[: n + tcp_auth.TAG]])
                seal.open_into(cipher[: n + tcp_auth.TAG], plain[:n])
                buf[d + off : d + off + n] = plain[:n]
        conn.sendall(seal.seal(ACK.pack(b"KVAK", total)))
        return True

    def _ranges_ok(self, ranges: list[tuple[int, int]], total: int, addr) -> bool:
        if _ranges_ok(ranges, self.nbytes, total):
            return True
        log.warning("tcp target: batch from %s writes outside [0, %d) or misstates its size; dropped", addr,
                    self.nbytes)
        return False


class _Conn:
    """An initiator's connection: a blocking socket whose calls the kernel bounds (``SO_SNDTIMEO``/``SO_RCVTIMEO``).

    A socket with a Python timeout polls before every send and receive; here the bound is armed to the time left
    until the write's deadline (give or take ``ARM_SLACK``) and re-armed only when that moves. A bound that fires
    raises ``BlockingIOError``: the deadline passed."""

    def __init__(self, sock: socket.socket, seal: tcp_auth.Seal | None = None) -> None:
        sock.settimeout(None)
        self.sock = sock
        self.armed = math.inf  # seconds the kernel allows one blocking call (none set yet: unbounded)
        self.seal = seal  # a sealed connection's, with its buffer for records on their way out
        self.scratch = memoryview(bytearray(SCRATCH)) if seal is not None else None

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
    def __init__(self, descriptor: TcpDescriptor, keys: tcp_auth.MemberKeys | None) -> None:
        super().__init__(descriptor)
        self.address = (descriptor.host, descriptor.port)
        self.target_id = bytes.fromhex(descriptor.id)
        self.keys = keys
        self._idle: collections.deque[_Conn] = collections.deque()  # append and pop are atomic: no lock needed
        if descriptor.members_only != (keys is not None):
            raise TransferError(f"tcp target {self.address} " + ("admits cluster members only, and this initiator "
                                "has no cluster key" if keys is None else "has no cluster key, unlike this initiator"))

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
            seal = self._hello(sock)
            if _recv_exact(sock, len(OK)) != OK:
                raise TransferError(f"tcp target {self.address} answered the hello wrongly")
        except (OSError, TransferError) as e:
            sock.close()
            if isinstance(e, TransferError):
                raise
            if isinstance(e, tcp_auth.Refused):
                raise TransferError(f"tcp target {self.address} refused: {e}") from e
            raise TransferError(f"tcp target {self.address} refused this descriptor (stale or wrong id, or not a "
                                f"member of this cluster): {e}") from e
        return _Conn(sock, seal)

    def _hello(self, sock: socket.socket) -> tcp_auth.Seal | None:
        """Say hello; with a cluster key, check the target's proof before proving ours (``tcp_auth.py``)."""
        if self.keys is None:
            sock.sendall(HELLO.pack(b"KVFH", self.target_id))
            return None
        nonce_i = tcp_auth.nonce()
        sock.sendall(tcp_auth.MEMBER_HELLO.pack(b"KVFM", self.target_id, nonce_i))
        magic, nonce_t, sealed, proof = tcp_auth.CHALLENGE.unpack(_recv_exact(sock, tcp_auth.CHALLENGE.size))
        if magic != b"KVFC" or sealed > 1:
            raise tcp_auth.Refused(f"it answered the hello with {magic!r}")
        transcript = tcp_auth.transcript(self.target_id, nonce_i, nonce_t, bool(sealed))
        self.keys.check(b"target", transcript, proof)
        sock.sendall(self.keys.proof(b"initiator", transcript))
        return self.keys.session(transcript, initiator=True) if sealed else None

    def give_back(self, conn: _Conn) -> None:
        self._idle.append(conn)

    def close_all(self) -> None:
        while self._idle:
            try:
                self._idle.pop().sock.close()
            except IndexError:
                return


class Initiator(KVInitiator):
    """Streams header + table + payload (gathered from the local region) per batch and waits for the ack.

    ``secret``: the cluster's data-plane secret, to write to targets that admit members only."""

    kind = "tcp"

    def __init__(self, nbytes: int, timeout: float = DEFAULT_TIMEOUT, secret: bytes | None = None) -> None:
        super().__init__(nbytes, timeout)
        self.keys = tcp_auth.MemberKeys(secret) if secret is not None else None

    def _connect(self, descriptor: Descriptor) -> PeerHandle:
        assert isinstance(descriptor, TcpDescriptor)  # connect checked the kind
        peer = TcpPeer(descriptor, self.keys)
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
        if conn.seal is not None:
            return self._send_sealed_batch(conn, plan, deadline)
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

    def _send_sealed_batch(self, conn: _Conn, plan: Plan, deadline: float) -> None:
        """The header and table as one record, then each segment in records of at most ``RECORD`` bytes, sealed
        into the connection's buffer and sent whenever it is full; then the sealed ack."""
        seal, out, buf = conn.seal, conn.scratch, self.buffer
        assert seal is not None and out is not None  # a sealed connection has its scratch buffer
        total = sum(n for _, _, n in plan)
        head = seal.seal(BATCH.pack(b"KVFB", len(plan), total) + _pack_table(plan))
        pending: list[bytes | memoryview] = [SEALED_HEAD.pack(len(head) - tcp_auth.TAG), head]
        used = 0
        for src, _, n in plan:
            for off in range(src, src + n, tcp_auth.RECORD):
                chunk = buf[off : min(off + tcp_auth.RECORD, src + n)]
                if used + len(chunk) + tcp_auth.TAG > len(out):
                    conn.send_all([*pending, out[:used]], sum(map(len, pending)) + used, deadline)
                    pending, used = [], 0
                seal.seal_into(chunk, out[used : used + len(chunk) + tcp_auth.TAG])
                used += len(chunk) + tcp_auth.TAG
        conn.send_all([*pending, out[:used]], sum(map(len, pending)) + used, deadline)
        ack = seal.open(conn.recv_exact(ACK.size + tcp_auth.TAG, deadline))
        magic, acked = ACK.unpack(ack)
        if magic != b"KVAK" or acked != total:
            raise TransferError(f"tcp target acked {acked} of {total} bytes ({magic!r})")

    def _disconnect(self, peer: PeerHandle) -> None:
        assert isinstance(peer, TcpPeer)
        peer.close_all()
