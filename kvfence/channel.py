"""The control plane: one ZeroMQ inbox per process, and lazily connected outboxes.

A process's id is the address its inbox is bound to, so any message that
names a peer also says how to reach it. Messages are one-way (PUSH/PULL);
a peer that is down simply does not answer, which the protocol cores handle
with timeouts and ``peer_down``.

Membership (``cluster.py``): with a cluster key every socket speaks CurveZMQ
with the cluster's one keypair. An inbox is a CURVE server and a ``Gate`` (the
ZAP handler of the channel's own ZeroMQ context) admits only clients that
prove they hold the cluster's secret key; an outbox is a CURVE client that
accepts only a server holding it. So a process without the key, or with
another cluster's, can neither deliver a message to a member nor receive one
from it, and every message is encrypted. Refused handshakes are logged on
both sides, throttled. Without a key (one host, development) sockets are
plain ZeroMQ and only loopback or ``ipc://`` addresses are allowed.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvfence.cluster import ClusterKey, Throttle, require_key_beyond_loopback
from kvfence.faults import Faults, FaultyLink
from kvfence.protocol.messages import BadMessage, Envelope, Message, decode_message, encode_message

log = logging.getLogger(__name__)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler about each CURVE client
ZAP_DOMAIN = b"kvfence"


class Channel:
    def __init__(self, bind: str, me: str | None = None, faults: Faults | None = None,
                 key: ClusterKey | None = None) -> None:
        """Bind the inbox at ``bind`` (``tcp://host:0`` picks a port); ``me`` is the id peers reach us by.

        ``key``: the cluster's; without one, ``bind`` and ``me`` must stay on this host (``ClusterKeyError``).
        ``faults`` (soak tests only) drops, duplicates and delays what this channel sends; it says so in the log.
        """
        require_key_beyond_loopback(key, {"bind": bind, "advertise": me})
        self.key = key
        self.ctx = zmq.Context()  # its own: the Gate is per context, and admits this channel's cluster only
        self.gate = Gate(self.ctx, key) if key else None  # bound before the inbox: libzmq admits all without one
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        secure(self.inbox, key, server=True)
        self.watch = HandshakeWatch(self.inbox, "inbox")
        self.outboxes: dict[str, zmq.Socket] = {}
        try:
            self.inbox.bind(bind)
        except zmq.ZMQError:
            self.close()  # the context and the Gate's thread with it
            raise
        bound = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        self.me = me or bound.replace("0.0.0.0", "127.0.0.1")
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.num_bad = 0
        self.epoch = 0  # this process's membership epoch, stamped on everything it sends (``Fenced``)
        self.fault_link = FaultyLink(faults, self.me) if faults else None
        if faults:
            log.warning("KVFENCE_FAULTS: %s injects faults (%s)", self.me, faults.describe())

    def send(self, to: str, msg: Message) -> None:
        """Queue ``msg`` for ``to``; never blocks (a full or dead peer drops it)."""
        data = encode_message(self.me, msg, self.epoch)
        if self.fault_link is None:
            self._push(to, data)
            return
        now = time.monotonic()
        for peer, payload in self.fault_link.due(now) + self.fault_link.outgoing(to, data, now):
            self._push(peer, payload)

    def _push(self, to: str, data: bytes) -> None:
        sock = self.outboxes.get(to)
        if sock is None:
            sock = self.outboxes[to] = connect_push(self.ctx, to, self.key)
        try:
            sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("control message to %s dropped: its queue is full", to)

    def receive(self, timeout_ms: int) -> list[Envelope]:
        """Everything waiting in the inbox, waiting up to ``timeout_ms`` for the first message."""
        self.watch.check()
        if self.fault_link is not None:
            for peer, payload in self.fault_link.due(time.monotonic()):
                self._push(peer, payload)
            if self.fault_link.held:
                timeout_ms = min(timeout_ms, 10)
        if not self.poller.poll(timeout_ms):
            return []
        envelopes: list[Envelope] = []
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return envelopes
            try:
                envelopes.append(decode_message(data))
            except BadMessage as exc:
                self.num_bad += 1
                log.error("dropped a malformed control message (%d bytes): %s", len(data), exc)

    @property
    def fd(self) -> int:
        """A file descriptor that turns readable when the inbox may have news (ZeroMQ's: edge-style, so a reader
        must drain the inbox with ``receive`` after each wake-up)."""
        fd = self.inbox.getsockopt(zmq.FD)
        assert isinstance(fd, int)  # an int option
        return fd

    def forget(self, peer: str) -> None:
        """Drop the outbox to a dead peer so that a restarted one gets a fresh connection."""
        sock = self.outboxes.pop(peer, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        """Close every socket, then the context (which ends the Gate's thread; the inbox is gone by then)."""
        for sock in self.outboxes.values():
            sock.close(0)
        self.watch.close()
        self.inbox.close(0)
        self.ctx.term()


def connect_push(ctx: zmq.Context, to: str, key: ClusterKey | None) -> zmq.Socket:
    """A PUSH socket connected to ``to``: a CURVE client of the cluster with ``key``, plain ZeroMQ without."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    secure(sock, key, server=False)
    sock.connect(to)
    return sock


def secure(sock: zmq.Socket, key: ClusterKey | None, server: bool) -> None:
    """Make ``sock`` (before it binds or connects) a CURVE server or client with the cluster's keypair. A client
    pins the server key: it talks only to a holder of the cluster's secret key."""
    if key is None:
        return
    curve = key.curve
    sock.curve_publickey, sock.curve_secretkey = curve.public, curve.secret
    if server:
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN
    else:
        sock.curve_serverkey = curve.public


class Gate:
    """The ZAP handler of one ZeroMQ context: admits a CURVE client only if it presents the cluster's public key.

    CurveZMQ proves that a client holds the secret half of the key it presents, so this admits exactly the holders
    of the cluster's secret. It is needed: without a ZAP handler libzmq admits any CURVE client, including one
    that knows the (not secret) server key but holds a keypair of its own. It runs until the context terminates;
    a request it cannot parse is refused.
    """

    def __init__(self, ctx: zmq.Context, key: ClusterKey) -> None:
        self.member = z85.decode(key.curve.public)
        self.refusals = Throttle(log)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        threading.Thread(target=self._serve, name="kvfence-zap", daemon=True).start()

    def _serve(self) -> None:
        try:
            while True:
                self.sock.send_multipart(self.answer(self.sock.recv_multipart()))
        except zmq.ContextTerminated:
            self.sock.close(0)

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply (RFC 27) to one request: 200 for a member, 400 for anyone else."""
        route, request_id = frames[:2], frames[3] if len(frames) > 3 else b""
        try:
            _, _, version, _, _, address, _, mechanism, *credentials = frames
            member = version == b"1.0" and mechanism == b"CURVE" and len(credentials) == 1 \
                and hmac.compare_digest(credentials[0], self.member)
        except ValueError:
            address, member = b"?", False
        if not member:
            self.refusals.warn("zap", "control plane: refused a connection from %s: it does not hold this "
                               "cluster's key", address.decode(errors="replace"))
        status = (b"200", b"OK") if member else (b"400", b"not a member of this cluster")
        return [*route, b"1.0", request_id, *status, b"", b""]


_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_WHY: dict[int, str] = {  # a handshake failure's value (a ZMTP protocol error) -> why, in words
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "one side has no cluster key",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "the two sides hold different cluster keys",
}


class HandshakeWatch:
    """Logs, throttled, each handshake that fails on ``sock``: on an inbox, the peers refused; on a worker's line
    to the router, why it cannot join. Call ``check`` now and then (``Channel.receive`` does)."""

    def __init__(self, sock: zmq.Socket, what: str) -> None:
        self.what = what
        self.monitor = sock.get_monitor_socket(_FAILED)
        self.sock = sock
        self.throttle = Throttle(log)

    def check(self) -> None:
        while self.monitor.poll(0):  # not a NOBLOCK recv: the zmq.Again it raises costs at every call
            event = recv_monitor_message(self.monitor)
            kind, value, endpoint = event["event"], event["value"], event["endpoint"].decode(errors="replace")
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = "refused by the cluster's gate: not this cluster's key"
                if self.what == "inbox":
                    continue  # the Gate logged it, with the peer's address
            else:
                why = _WHY.get(value, "the handshake broke off (a peer without the key, or with another cluster's)")
            if self.what == "inbox":
                self.throttle.warn(str(value), "control plane: refused a connection to %s: %s", endpoint, why)
            else:
                self.throttle.warn(str(value), "control plane: cannot join the %s at %s: %s; every process of a "
                                   "cluster needs the same --cluster-key", self.what, endpoint, why)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
