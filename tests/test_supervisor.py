"""Supervised workers never outlive their supervisor, even one that dies while they are still starting."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

from kvfence.workers.supervisor import _die_with_parent


def _worker(start_s: float) -> None:
    time.sleep(start_s)  # a worker's interpreter and imports take this long; its supervisor dies meanwhile
    _die_with_parent()
    time.sleep(60)


def _supervisor(pid_file: str, start_s: float) -> None:
    worker = mp.get_context("spawn").Process(target=_worker, args=(start_s,))
    worker.start()
    Path(pid_file).write_text(str(worker.pid))
    os._exit(0)  # dies at once, as under SIGKILL: nothing stops its child


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_worker_whose_supervisor_died_while_it_started_exits(tmp_path):
    pid_file = tmp_path / "worker.pid"
    supervisor = mp.get_context("spawn").Process(target=_supervisor, args=(str(pid_file), 1.0))
    supervisor.start()
    supervisor.join(30)
    worker = int(pid_file.read_text())
    try:
        deadline = time.monotonic() + 20
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(worker), "the orphaned worker kept running"
    finally:
        if _running(worker):
            os.kill(worker, 9)
