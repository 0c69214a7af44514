"""The control plane: one ZeroMQ inbox per process, and lazily connected outboxes.

A process's id is the address its inbox is bound to, so any message that
names a peer also says how to reach it. Messages are one-way (PUSH/PULL);
a peer that is down simply does not answer, which the protocol cores handle
with timeouts and ``peer_down``.
"""

from __future__ import annotations

import logging
import time

import zmq

from kvfence.faults import Faults, FaultyLink
from kvfence.protocol.messages import BadMessage, Envelope, Message, decode_message, encode_message

log = logging.getLogger(__name__)


class Channel:
    def __init__(self, bind: str, me: str | None = None, faults: Faults | None = None) -> None:
        """Bind the inbox at ``bind`` (``tcp://host:0`` picks a port); ``me`` is the id peers reach us by.

        ``faults`` (soak tests only) drops, duplicates and delays what this channel sends; it says so in the log.
        """
        self.ctx = zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(bind)
        bound = self.inbox.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.me = me or bound.replace("0.0.0.0", "127.0.0.1")
        self.outboxes: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.num_bad = 0
        self.fault_link = FaultyLink(faults, self.me) if faults else None
        if faults:
            log.warning("KVFENCE_FAULTS: %s injects faults (%s)", self.me, faults.describe())

    def send(self, to: str, msg: Message) -> None:
        """Queue ``msg`` for ``to``; never blocks (a full or dead peer drops it)."""
        data = encode_message(self.me, msg)
        if self.fault_link is None:
            self._push(to, data)
            return
        now = time.monotonic()
        for peer, payload in self.fault_link.due(now) + self.fault_link.outgoing(to, data, now):
            self._push(peer, payload)

    def _push(self, to: str, data: bytes) -> None:
        sock = self.outboxes.get(to)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.connect(to)
            self.outboxes[to] = sock
        try:
            sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("control message to %s dropped: its queue is full", to)

    def receive(self, timeout_ms: int) -> list[Envelope]:
        """Everything waiting in the inbox, waiting up to ``timeout_ms`` for the first message."""
        if self.fault_link is not None:
            for peer, payload in self.fault_link.due(time.monotonic()):
                self._push(peer, payload)
            if self.fault_link.held:
                timeout_ms = min(timeout_ms, 10)
        if not self.poller.poll(timeout_ms):
            return []
        envelopes = []
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
        return self.inbox.getsockopt(zmq.FD)

    def forget(self, peer: str) -> None:
        """Drop the outbox to a dead peer so that a restarted one gets a fresh connection."""
        sock = self.outboxes.pop(peer, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for sock in self.outboxes.values():
            sock.close(0)
        self.inbox.close(0)
