"""Supervised workers never outlive their supervisor, even one that dies while they are still starting, and are not
restarted while the server stops."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import openai

from kvfence.workers.supervisor import _die_with_parent
from tests.server import Server
from tests.tiny_models import tiny_model_dir


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


def test_stopping_the_whole_process_group_restarts_no_worker():
    """Ctrl-C in a terminal or SIGTERM to the process group reaches the workers as well as the server: they die
    at once while the server shuts down. The supervisor must not start them again, and still report them, so a
    stream open at that moment fails at once and the server exits within seconds."""
    server = Server("--model", str(tiny_model_dir("llama")), "--max-context", "4096")
    ended: dict[str, object] = {}

    def stream() -> None:
        try:
            chunks = server.client(timeout=60).completions.create(
                model="llama", prompt="story", max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
            ended["outcome"] = f"finished after {sum(1 for _ in chunks)} chunks"
        except openai.APIError as e:
            ended["outcome"] = e
        ended["at"] = time.monotonic()

    try:
        workers = list(server.health()["workers"].values())
        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(1)
        killed_at = time.monotonic()
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(30)
        reader.join(30)
        assert time.monotonic() - killed_at < 5, "the server took too long to stop"
        assert isinstance(ended["outcome"], openai.APIError) and ended["at"] - killed_at < 5, ended
        assert "restarting it" not in server.output()
        assert not [w["pid"] for w in workers if _running(w["pid"])]
    finally:
        server.stop()
