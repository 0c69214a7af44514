"""Supervised workers never outlive their supervisor, even one that dies while they are still starting, and are not
restarted while the server stops. A stop drains what is in flight, then leaves no process and no KV segment."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from kvfence.workers.supervisor import _die_with_parent
from tests.server import Server
from tests.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


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


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = [int(c) for c in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
        except FileNotFoundError:
            continue
        found += children
        todo += children
    return found


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("kvfence-kv-*")}


def _wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Stream(threading.Thread):
    """One streamed completion of ``max_tokens`` tokens: ``tokens`` the usage it reported, ``error`` how it ended."""

    def __init__(self, server: Server, max_tokens: int) -> None:
        super().__init__()
        self.server, self.max_tokens = server, max_tokens
        self.tokens, self.finish, self.error = 0, None, None
        self.first = threading.Event()

    def run(self) -> None:
        try:
            chunks = self.server.client(timeout=60).completions.create(
                model="llama", prompt="story", max_tokens=self.max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in chunks:
                self.first.set()
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens
                if chunk.choices:
                    self.finish = chunk.choices[0].finish_reason or self.finish
        except (openai.APIError, openai.APIConnectionError) as e:
            self.error = e
        self.first.set()
        self.ended_at = time.monotonic()


def _serve(*args: str) -> tuple[Server, list[int], set[str]]:
    """A disaggregated deployment of the tiny model, its worker pids, and the KV segments it created."""
    before = _segments()
    server = Server("--model", str(tiny_model_dir("llama")), "--max-context", "4096", *args)
    workers = _descendants(server.proc.pid)
    created = _segments() - before
    assert workers and created, "expected worker processes and a decode KV segment"
    return server, workers, created


def _refuses(server: Server) -> bool:
    """The server no longer takes connections."""
    try:
        server.client(timeout=5).models.list()
    except openai.APIConnectionError:
        return True
    return False


def _gone(server: Server, workers: list[int], created: set[str], timeout: float) -> bool:
    return _wait_for(lambda: server.proc.poll() is not None and not [w for w in workers if _running(w)]
                     and not created & _segments(), timeout)


def test_sigterm_to_the_whole_group_drains_the_streams_in_flight_then_stops_everything():
    """A service manager's SIGTERM reaches the server and its workers alike. The stream in flight still finishes;
    new connections are refused at once; then every process exits and the decode KV segment is unlinked, within
    10 s of the drain's end, and no worker was restarted."""
    server, workers, created = _serve("--drain-timeout", "60")
    try:
        stream = Stream(server, max_tokens=300)
        stream.start()
        assert stream.first.wait(30)
        os.killpg(server.proc.pid, signal.SIGTERM)
        assert _wait_for(lambda: _refuses(server), 10), "new connections were still accepted during the drain"
        stream.join(60)
        assert stream.error is None and stream.finish == "length" and stream.tokens == 300, stream.error
        assert _gone(server, workers, created, timeout=10), server.output()
        assert server.proc.returncode == 0
        assert "restarting it" not in server.output()
    finally:
        server.stop()


def test_a_drain_that_times_out_ends_the_stream_and_still_cleans_up():
    """Ctrl-C (SIGINT to the group) with a stream that would outlast ``--drain-timeout``: the stream is cut when the
    drain ends, and every process and segment is gone within 10 s after."""
    server, workers, created = _serve("--drain-timeout", "1")
    try:
        stream = Stream(server, max_tokens=3000)
        stream.start()
        assert stream.first.wait(30)
        signalled = time.monotonic()
        os.killpg(server.proc.pid, signal.SIGINT)
        stream.join(30)
        assert stream.finish != "length" and stream.ended_at - signalled < 6, (stream.tokens, stream.error)
        assert _gone(server, workers, created, timeout=11), server.output()
        assert "restarting it" not in server.output()
    finally:
        server.stop()


def test_workers_of_a_killed_server_stop_and_unlink_their_segments():
    """SIGKILL leaves the server no say: its workers learn of its death from the kernel and close on their own."""
    server, workers, created = _serve()
    try:
        server.proc.kill()
        assert _gone(server, workers, created, timeout=10), server.output()
    finally:
        server.stop()


def test_a_standalone_worker_stops_cleanly_on_sigterm(tmp_path):
    """``kvfence decode`` on its own (multi-host use) exits 0 on SIGTERM and unlinks its shm segment."""
    before = _segments()
    log = open(tmp_path / "decode.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "kvfence.cli", "decode", "--model", str(tiny_model_dir("llama")),
                             "--max-context", "1024", "--router", "tcp://127.0.0.1:9", "--bind", "tcp://127.0.0.1:0",
                             "--transfer", "shm"], stdout=log, stderr=subprocess.STDOUT)
    try:
        assert _wait_for(lambda: _segments() - before or proc.poll() is not None, 60)
        created = _segments() - before
        assert created, (tmp_path / "decode.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert not created & _segments()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
