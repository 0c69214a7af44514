"""Starts local worker processes, restarts any that die, and stops them all on exit."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
from collections.abc import Callable

from kvfence.workers.settings import WorkerSettings

log = logging.getLogger(__name__)


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """A ZeroMQ address on a port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def run_worker(settings: WorkerSettings, supervised: bool = True) -> None:
    """Entry point of a worker process. Supervised workers leave Ctrl-C to their parent and die with it."""
    if supervised:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _die_with_parent()
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {settings.role}[%(process)d] %(name)s: %(message)s")
    if settings.role == "prefill":
        from kvfence.workers.prefill import main
    else:
        from kvfence.workers.decode import main
    try:
        main(settings)
    except KeyboardInterrupt:
        pass


def _die_with_parent() -> None:
    """SIGTERM this process when its parent dies, and exit now if the parent already has: a worker spawned
    just before its supervisor died (say a restart racing a SIGTERM) only gets here after its interpreter
    started, and the kernel signals deaths that come after the request only."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
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
        self.procs: dict[str, mp.Process] = {}
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
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(1)
        self.procs.clear()

    def pids(self) -> dict[str, int | None]:
        return {w: p.pid for w, p in self.procs.items()}

    def _spawn(self, worker: str) -> None:
        proc = self.ctx.Process(target=run_worker, args=(self.settings[worker],), name=f"kvfence-{worker}",
                                daemon=True)
        proc.start()
        self.procs[worker] = proc
