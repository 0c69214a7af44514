"""A ``KVTarget`` in a child process, driven over a pipe: the far side of the conformance tests and benchmarks.

The child is started with ``spawn`` (no inherited state, as a real decode
worker) and answers commands about its region: read a range, hash a range,
fill it. ``kill()`` sends SIGKILL, the way a crashed worker disappears.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import numpy as np
import xxhash

from kvfence.descriptors import Descriptor
from kvfence.transfer.base import Region, TransferError, make_target


class TargetProcess:
    """Backend ``kind``'s target of ``nbytes`` in a spawned child. ``descriptor`` is ready on return."""

    def __init__(self, kind: str, nbytes: int, start_timeout: float = 60.0, **opts: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main, args=(kind, nbytes, opts, child), daemon=True, name=f"kvfence-{kind}-target"
        )
        self.proc.start()
        child.close()
        self.kind, self.nbytes = kind, nbytes
        self.descriptor: Descriptor = self._reply(start_timeout, f"{kind} target failed to start")

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._call("read", offset, nbytes)

    def digest(self, offset: int = 0, nbytes: int | None = None) -> int:
        """xxh3-64 of the region's bytes ``[offset, offset + nbytes)`` (default: to the end)."""
        return self._call("digest", offset, self.nbytes - offset if nbytes is None else nbytes)

    def fill(self, byte: int) -> None:
        self._call("fill", byte)

    def close_target(self) -> None:
        """Close the target gracefully but keep the child process (and its mapping) alive."""
        self._call("close_target")

    def raw_sink(self) -> tuple[str, int]:
        """Start a bare socket receiver in the child, a baseline: each message is (offset u64, length u64,
        payload), received into a region of ``nbytes`` at ``offset`` and acked with one byte."""
        return tuple(self._call("raw_sink"))

    def pin(self, cpus: set[int]) -> None:
        """Run every thread of the child on ``cpus`` (threads it starts later inherit it from their creator)."""
        assert self.proc.pid is not None  # started in __init__
        pin_threads(self.proc.pid, cpus)

    def freeze(self, timeout: float = 10.0) -> None:
        """SIGSTOP the child and return once every thread of it is stopped: the signal alone is asynchronous, and
        on a loaded host the child could still answer a write sent right after ``os.kill`` returned."""
        assert self.proc.pid is not None  # started in __init__
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _all_threads_stopped(self.proc.pid):
            if time.monotonic() > deadline:
                raise TransferError(f"the target did not stop within {timeout} s")
            time.sleep(0.001)

    def thaw(self) -> None:
        """SIGCONT the child after ``freeze``."""
        assert self.proc.pid is not None  # started in __init__
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        if self.proc.is_alive():
            assert self.proc.pid is not None  # started in __init__
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("close",))
                self.proc.join(10)
            except OSError:
                pass
        self.kill()
        self._conn.close()

    def _call(self, *cmd: Any, timeout: float = 60.0) -> Any:
        self._conn.send(cmd)
        return self._reply(timeout, f"target command {cmd[0]} failed")

    def _reply(self, timeout: float, what: str) -> Any:
        if not self._conn.poll(timeout):
            raise TransferError(f"{what}: no answer within {timeout} s")
        try:
            ok, payload = self._conn.recv()
        except EOFError:
            raise TransferError(f"{what}: the target process exited (code {self.proc.exitcode})") from None
        if not ok:
            raise TransferError(f"{what}: {payload}")
        return payload


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Set the CPU affinity of every thread of process ``pid`` (``sched_setaffinity`` of a pid sets one thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in its ``/proc`` stat line)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        if state != "T":
            return False
    return True


def _child_main(kind: str, nbytes: int, opts: dict, conn: Any) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a parent's exit terminates us: clean up first
    try:
        target = make_target(kind, nbytes, **opts)
    except Exception as e:  # reported to the parent, which raises it
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    try:
        conn.send((True, target.descriptor()))
        _serve_commands(_Handlers(target), conn)
    finally:
        target.close()


def _serve_commands(handlers: _Handlers, conn: Any) -> None:
    while True:
        try:
            cmd, *args = conn.recv()
        except (EOFError, OSError):
            return  # parent gone
        if cmd == "close":
            return
        try:
            conn.send((True, getattr(handlers, cmd)(*args)))
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}"))


class _Handlers:
    def __init__(self, target: Any) -> None:
        self.target = target
        self.bytes = np.frombuffer(target.buffer, dtype=np.uint8)

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self.target.buffer[offset : offset + nbytes])

    def digest(self, offset: int, nbytes: int) -> int:
        return xxhash.xxh3_64_intdigest(self.target.buffer[offset : offset + nbytes])

    def fill(self, byte: int) -> None:
        self.bytes.fill(byte)

    def close_target(self) -> None:
        self.target.close()

    def raw_sink(self) -> tuple[str, int]:
        listener = socket.create_server(("127.0.0.1", 0))
        region = Region.anonymous(self.target.nbytes)
        threading.Thread(target=_sink_loop, args=(listener, region), daemon=True).start()
        return listener.getsockname()[:2]


def _sink_loop(listener: socket.socket, region: Region) -> None:
    """Receive (offset, length, payload) messages into ``region`` and ack each with one byte."""
    from kvfence.transfer.tcp import _recv_exact, _tune

    while True:
        conn, _ = listener.accept()
        _tune(conn)
        view = region.buffer
        try:
            while True:
                head = _recv_exact(conn, 16)
                off, n = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
                got = 0
                while got < n:
                    k = conn.recv_into(view[off + got : off + n], n - got, socket.MSG_WAITALL)
                    if not k:
                        raise ConnectionError("closed")
                    got += k
                conn.sendall(b"k")
        except OSError:
            conn.close()
