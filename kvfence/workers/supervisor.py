"""Starts local worker processes, restarts any that die, and stops them all on exit."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from kvfence.workers.settings import WorkerSettings

if TYPE_CHECKING:
    from kvfence.workers.common import WorkerBase

log = logging.getLogger(__name__)


def private_socket_dir() -> str:
    """A new directory only this user may enter (0700), for one deployment's control sockets (``ipc://``): unlike
    loopback ports picked in advance, its paths cannot be taken by another process meanwhile, and no other user
    can reach them. The caller removes it."""
    return tempfile.mkdtemp(prefix="kvfence-")


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """A ZeroMQ address on a port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


STOP_SIGNAL = signal.SIGUSR1  # a supervised worker's only stop: it finishes its step, closes and exits


def run_worker(settings: WorkerSettings, supervised: bool = True) -> None:
    """Entry point of a worker process. It stops cleanly (channel closed, data plane released: decode's shm segment
    unlinked) on ``STOP_SIGNAL`` when supervised, on SIGINT or SIGTERM when not.

    A supervised worker ignores SIGINT and SIGTERM: Ctrl-C in a terminal, or a service manager's SIGTERM to the
    whole group, reaches it too, and it must keep serving while the server drains. Its supervisor stops it once
    the drain ends, and its death sends it ``STOP_SIGNAL`` as well.
    """
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {settings.role}[%(process)d] %(name)s: %(message)s")
    stops = [STOP_SIGNAL] if supervised else [signal.SIGINT, signal.SIGTERM]
    if supervised:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    stop = _StopLatch(stops)
    if supervised:
        _die_with_parent()
    Worker: type[WorkerBase]
    if settings.role == "prefill":
        from kvfence.workers.prefill import PrefillWorker as Worker
    else:
        from kvfence.workers.decode import DecodeWorker as Worker
    if stop.requested:  # asked to stop while the model loaded
        return
    worker = Worker(settings)
    try:
        stop.forward_to(worker.request_stop)
        worker.run_forever()
    finally:
        worker.close()


class _StopLatch:
    """Catches the stop signals from the start, before the worker exists to hear them, and passes them on."""

    def __init__(self, signals: Sequence[int]) -> None:
        self.requested = False
        self._target: Callable[[], None] | None = None
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, *_: object) -> None:
        self.requested = True
        if self._target is not None:
            self._target()

    def forward_to(self, target: Callable[[], None]) -> None:
        self._target = target
        if self.requested:
            target()


def _die_with_parent() -> None:
    """Send this process ``STOP_SIGNAL`` when its parent dies, and exit now if the parent already has: a worker
    spawned just before its supervisor died (say a restart racing a SIGKILL) only gets here after its interpreter
    started, and the kernel signals deaths that come after the request only."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, STOP_SIGNAL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        log.warning("supervisor %d is gone; exiting", parent.pid)
        sys.exit(0)


class Supervisor:
    """Keeps one process per ``WorkerSettings`` alive. Worker ids are their fixed bind addresses."""

    def __init__(self, workers: list[WorkerSettings], on_death: Callable[[str], None]) -> None:
        self.ctx = mp.get_context("spawn")
        self.settings = {s.bind: s for s in workers}
        self.procs: dict[str, BaseProcess] = {}
        self.on_death = on_death
        self.restarts = 0

    def start(self) -> None:
        for worker in self.settings:
            self._spawn(worker)

    def poll(self, restart: bool = True) -> None:
        """Notice dead workers: report each, then start it again, or, with ``restart`` False (the server is
        stopping), forget it."""
        for worker, proc in list(self.procs.items()):
            if proc.exitcode is None:
                continue
            role = self.settings[worker].role
            if restart:
                log.error("%s worker %s exited with code %s; restarting it", role, worker, proc.exitcode)
            else:
                log.info("%s worker %s exited with code %s while the server stops", role, worker, proc.exitcode)
            self.on_death(worker)
            if restart:
                self.restarts += 1
                self._spawn(worker)
            else:
                del self.procs[worker]

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every worker: ``STOP_SIGNAL``, up to ``timeout`` seconds to close, then SIGKILL. Then unlink any shm
        segment a killed decode worker left behind (a live deployment's segments are locked and stay)."""
        for proc in self.procs.values():
            if proc.is_alive():
                assert proc.pid is not None  # started
                os.kill(proc.pid, STOP_SIGNAL)
        deadline = time.monotonic() + timeout
        for worker, proc in self.procs.items():
            proc.join(max(deadline - time.monotonic(), 0))
            if proc.is_alive():
                log.warning("%s worker %s did not stop in %.0fs; killing it", self.settings[worker].role, worker,
                            timeout)
                proc.kill()
                proc.join(1)
        self.procs.clear()
        if any(s.transfer == "shm" for s in self.settings.values()):
            from kvfence.transfer.shm import DEFAULT_DIR, sweep_stale

            sweep_stale(DEFAULT_DIR)

    def pids(self) -> dict[str, int | None]:
        return {w: p.pid for w, p in self.procs.items()}

    def _spawn(self, worker: str) -> None:
        proc = self.ctx.Process(target=run_worker, args=(self.settings[worker],), name=f"kvfence-{worker}",
                                daemon=True)
        proc.start()
        self.procs[worker] = proc
