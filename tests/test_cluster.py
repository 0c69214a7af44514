"""Cluster membership (issue #18, part 2): the key file, CurveZMQ on every control socket, and who may join.

The control-plane tests use real ZeroMQ sockets: the router is a real ``RemoteEngine`` on an event loop in a
thread, and the rogues are the worker's own ``Channel`` or bare sockets; the last ones start real
``kvfence prefill``/``decode`` processes, members and rogues, against it. One test covers how often that
router polls its inbox.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from kvfence.channel import Channel, connect_push
from kvfence.cluster import ClusterKey, ClusterKeyError, is_local, key_from, require_key_beyond_loopback
from kvfence.core import Request, SamplingParams
from kvfence.protocol.messages import Done, ErrorInfo, Hello, Output, Reject, encode_message
from kvfence.router.remote import RemoteEngine
from kvfence.router.settings import RouterSettings
from kvfence.workers.supervisor import free_tcp_address
from tests.server import ROOT
from tests.sides import side

# ---------------------------------------------------------------------------- the key file


@pytest.mark.fast
def test_key_file_is_written_0600_and_loads_back(tmp_path):
    key = ClusterKey.generate()
    path = tmp_path / "cluster.key"
    key.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ClusterKey.load(path) == key
    assert key.secret.hex() not in repr(key) and key.secret.hex() not in repr(pickle.loads(pickle.dumps(key)))
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.key"]  # no temporary file left behind


@pytest.mark.fast
def test_key_file_is_never_overwritten_silently(tmp_path):
    path = tmp_path / "cluster.key"
    first = ClusterKey.generate()
    first.write(path)
    with pytest.raises(ClusterKeyError, match="exists"):
        ClusterKey.generate().write(path)
    assert ClusterKey.load(path) == first
    second = ClusterKey.generate()
    second.write(path, overwrite=True)
    assert ClusterKey.load(path) == second and stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.fast
@pytest.mark.parametrize("content, mode, error", [
    (None, 0o600, "No such file"),
    ("kvfence-cluster-key-v1 " + "ab" * 32 + "\n", 0o644, "chmod 600"),
    ("kvfence-cluster-key-v1 " + "ab" * 32 + "\n", 0o640, "chmod 600"),
    ("kvfence-cluster-key-v1 " + "ab" * 31 + "\n", 0o600, "64 hex digits"),
    ("kvfence-cluster-key-v1 " + "zz" * 32 + "\n", 0o600, "64 hex digits"),
    ("ssh-ed25519 AAAAC3Nza\n", 0o600, "malformed"),
    ("", 0o600, "malformed"),
    ("kvfence-cluster-key-v1 " + "ab" * 32 + "\nkvfence-cluster-key-v1 " + "cd" * 32 + "\n", 0o600, "malformed"),
])
def test_unusable_key_files_are_refused_with_the_reason(tmp_path, content, mode, error):
    path = tmp_path / "cluster.key"
    if content is not None:
        path.write_text(content)
        path.chmod(mode)
    with pytest.raises(ClusterKeyError, match=error):
        ClusterKey.load(path)


@pytest.mark.fast
def test_a_directory_or_an_unreadable_file_is_refused(tmp_path):
    with pytest.raises(ClusterKeyError, match="not a regular file"):
        ClusterKey.load(tmp_path)
    path = tmp_path / "cluster.key"
    ClusterKey.generate().write(path)
    path.chmod(0o000)
    if os.geteuid() != 0:  # root reads it anyway
        with pytest.raises(ClusterKeyError, match="Permission denied"):
            ClusterKey.load(path)


@pytest.mark.fast
def test_the_environment_names_the_key_file_when_no_flag_does(tmp_path, monkeypatch):
    key, other = ClusterKey.generate(), ClusterKey.generate()
    key.write(tmp_path / "a.key")
    other.write(tmp_path / "b.key")
    monkeypatch.delenv("KVFENCE_CLUSTER_KEY", raising=False)
    assert key_from(None) is None
    monkeypatch.setenv("KVFENCE_CLUSTER_KEY", str(tmp_path / "a.key"))
    assert key_from(None) == key
    assert key_from(str(tmp_path / "b.key")) == other  # the flag wins


@pytest.mark.fast
def test_each_plane_gets_its_own_derived_secret():
    key = ClusterKey(bytes(32))
    assert key.curve == ClusterKey(bytes(32)).curve  # every member derives the same keypair
    assert key.curve.public == zmq.curve_public(key.curve.secret)
    secrets = {key.derive("curve"), key.data_plane_secret, key.derive("fingerprint"), key.secret}
    assert len(secrets) == 4
    assert ClusterKey.generate().curve != key.curve


@pytest.mark.fast
@pytest.mark.parametrize("address, local", [
    ("tcp://127.0.0.1:5550", True), ("tcp://127.1.2.3:1", True), ("tcp://localhost:1", True),
    ("tcp://[::1]:1", True), ("ipc:///tmp/x", True), ("inproc://x", True),
    ("tcp://0.0.0.0:5550", False), ("tcp://*:5550", False), ("tcp://10.0.0.1:5550", False),
    ("tcp://[::]:1", False), ("tcp://eth0:5550", False), ("tcp://router.internal:5550", False),
])
def test_what_counts_as_staying_on_this_host(address, local):
    assert is_local(address) is local


@pytest.mark.fast
def test_addresses_beyond_loopback_need_a_key_and_the_error_names_the_flag():
    require_key_beyond_loopback(None, {"--bind": "tcp://127.0.0.1:5550", "--advertise": None})
    require_key_beyond_loopback(ClusterKey.generate(), {"--bind": "tcp://0.0.0.0:5550"})
    with pytest.raises(ClusterKeyError, match="--bind tcp://0.0.0.0:5550 .*--cluster-key"):
        require_key_beyond_loopback(None, {"--bind": "tcp://0.0.0.0:5550"})
    with pytest.raises(ClusterKeyError):
        Channel("tcp://0.0.0.0:0")


def kvfence(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfence.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_cluster_key_command_writes_a_key_and_refuses_to_overwrite_it(tmp_path):
    path = tmp_path / "cluster.key"
    done = kvfence("cluster-key", str(path))
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = ClusterKey.load(path)
    assert key.fingerprint in done.stderr and "--cluster-key" in done.stderr
    again = kvfence("cluster-key", str(path))
    assert again.returncode != 0 and "exists" in again.stderr
    assert ClusterKey.load(path) == key
    assert kvfence("cluster-key", "--force", str(path)).returncode == 0
    assert ClusterKey.load(path) != key


@pytest.mark.slow
def test_router_and_workers_refuse_to_reach_beyond_loopback_without_a_key(tmp_path):
    """Each exits at once (before loading anything) with an error that names --cluster-key (or the file and what
    is wrong with it)."""
    bad = tmp_path / "open.key"
    bad.write_text("kvfence-cluster-key-v1 " + "ab" * 32 + "\n")
    bad.chmod(0o644)
    runs = {
        "router": kvfence("router", "--bind", "tcp://0.0.0.0:1"),
        "router (default bind)": kvfence("router"),
        "prefill": kvfence("prefill", "--router", "tcp://127.0.0.1:1", "--bind", "tcp://0.0.0.0:1"),
        "decode": kvfence("decode", "--router", "tcp://127.0.0.1:1", "--bind", "tcp://127.0.0.1:1",
                          "--advertise", "tcp://10.0.0.2:1"),
        "missing file": kvfence("router", "--cluster-key", str(tmp_path / "nope.key")),
        "env, too open": kvfence("prefill", "--router", "tcp://127.0.0.1:1", env={"KVFENCE_CLUSTER_KEY": str(bad)}),
    }
    said = {"env, too open": ("chmod 600", "$KVFENCE_CLUSTER_KEY"), "missing file": ("No such file", "--cluster-key")}
    for name, run in runs.items():
        assert run.returncode != 0, name
        for words in said.get(name, ("reaches beyond this host", "--cluster-key")):
            assert words in run.stderr, (name, run.stderr)


# ---------------------------------------------------------------------------- the control plane


def receive_for(channel: Channel, seconds: float) -> list:
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        got += channel.receive(50)
    return got


def hello(worker: str, role: str) -> Hello:
    return Hello(worker, worker, side(role), 4096, 4096, free_pages=256, total_pages=256)


def rogue_sockets(ctx: zmq.Context, to: str, key: ClusterKey) -> dict[str, zmq.Socket]:
    """PUSH sockets to ``to`` for each kind of outsider: no key at all; another cluster's key; the cluster's public
    key (not secret) as the server key, with a keypair of its own."""
    sockets = {name: ctx.socket(zmq.PUSH) for name in ("no key", "other cluster", "public key only")}
    other = ClusterKey.generate().curve
    s = sockets["other cluster"]
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = other.public, other.secret, other.public
    own_public, own_secret = zmq.curve_keypair()
    s = sockets["public key only"]
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = own_public, own_secret, key.curve.public
    for s in sockets.values():
        s.setsockopt(zmq.LINGER, 0)
        s.connect(to)
    return sockets


@pytest.mark.slow
def test_members_talk_and_outsiders_deliver_nothing(caplog):
    key = ClusterKey.generate()
    inbox, member = Channel("tcp://127.0.0.1:0", key=key), Channel("tcp://127.0.0.1:0", key=key)
    stranger = Channel("tcp://127.0.0.1:0", key=ClusterKey.generate())
    keyless = Channel("tcp://127.0.0.1:0")
    ctx = zmq.Context()
    rogues = rogue_sockets(ctx, inbox.me, key)
    caplog.set_level(logging.WARNING, logger="kvfence.channel")
    try:
        for ch in (member, stranger, keyless):
            ch.send(inbox.me, hello(ch.me, "prefill"))
        for name, s in rogues.items():
            s.send(encode_message(name, hello(name, "prefill")))
        got = receive_for(inbox, 1.5)
        assert [env.sender for env in got] == [member.me]
        inbox.send(member.me, hello(inbox.me, "decode"))  # and back: the member's inbox admits the first one
        assert [env.sender for env in receive_for(member, 1.0)] == [inbox.me]
        # Each outsider retries; one attempt may break off before its mechanism is read (the peer hung up first,
        # more likely on a loaded host), so wait for every reason to show, delivering nothing meanwhile.
        reasons = ("does not hold this cluster's key", "different cluster keys", "no cluster key")  # 1st: the Gate
        deadline = time.monotonic() + 10
        while True:
            refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
            missing = [why for why in reasons if not any(why in m for m in refusals)]
            if not missing or time.monotonic() > deadline:
                break
            assert receive_for(inbox, 0.2) == []
        assert not missing, refusals
        assert len(refusals) < 10, refusals  # each rogue retried many times: throttled
    finally:
        ctx.destroy(linger=0)
        for ch in (inbox, member, stranger, keyless):
            ch.close()


@pytest.mark.slow
def test_a_member_never_sends_to_an_outsider_listening_at_a_members_address():
    """An outbox is a CURVE client that pins the cluster's server key: a process that took a member's address
    but lacks the key (or holds another cluster's) receives nothing."""
    key = ClusterKey.generate()
    member = Channel("tcp://127.0.0.1:0", key=key)
    for impostor in (Channel("tcp://127.0.0.1:0"), Channel("tcp://127.0.0.1:0", key=ClusterKey.generate())):
        member.send(impostor.me, hello(member.me, "decode"))
        assert receive_for(impostor, 1.0) == []
        impostor.close()
    member.close()


class Router:
    """A real ``RemoteEngine`` on an event loop in its own thread, as the router process runs it."""

    def __init__(self, key: ClusterKey | None) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.address = free_tcp_address()
        self.engine: RemoteEngine = self.call(lambda: RemoteEngine(RouterSettings(self.address, "llama", 4096,
                                                                                  cluster_key=key)))
        self.call(self.engine.start)

    def call(self, fn):
        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def workers(self) -> set[str]:
        return self.call(lambda: set(self.engine.core.workers))

    def submit(self, prompt_ids: list[int], max_tokens: int = 8) -> tuple[int, asyncio.Future]:
        """Start a greedy request; returns its id and a future of ``(token_ids, text, error)``."""
        request = Request(prompt_ids, SamplingParams(max_tokens, temperature=0.0, ignore_eos=True))

        async def collect():
            ids, text = [], ""
            try:
                async for out in self.engine.generate(request):
                    ids, text = ids + out.token_ids, text + out.text
            except Exception as e:  # noqa: BLE001 (the error is the result)
                return ids, text, e
            return ids, text, None

        return request.rid, asyncio.run_coroutine_threadsafe(collect(), self.loop)

    def close(self) -> None:
        async def stop():
            for task in self.engine._tasks:
                task.cancel()
            await asyncio.gather(*self.engine._tasks, return_exceptions=True)
            self.engine.channel.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def offer(sock: zmq.Socket, data: bytes) -> None:
    """Send without blocking: a socket whose handshakes fail may have nowhere to queue the message."""
    try:
        sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        pass


def heartbeat(ctx: zmq.Context, to: str, key: ClusterKey, data: bytes, stop: threading.Event) -> threading.Thread:
    """Send ``data`` (a member's Hello) to ``to`` every half second from a thread of its own, as workers do; the
    thread ends (and closes its socket) once ``stop`` is set."""

    def run() -> None:
        sock = connect_push(ctx, to, key)
        while not stop.is_set():
            offer(sock, data)
            stop.wait(0.5)
        sock.close(0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_forged_hello_done_output_and_reject_from_outsiders_have_no_effect():
    """The test plays a member prefill and decode (the worker's ``Channel`` with the key) against a real router.
    Outsiders (no key, another cluster's key, only the public key) then forge a Hello, a Done to the decode worker,
    and an Output and a Reject for a live request, claiming to be the decode worker: none is processed. The same
    forgeries from a member socket do take effect, so it is the key that stops them."""
    key = ClusterKey.generate()
    router = Router(key)
    prefill, decode = Channel("tcp://127.0.0.1:0", key=key), Channel("tcp://127.0.0.1:0", key=key)
    ctx, stop, beats = zmq.Context(), threading.Event(), []
    try:
        for member, role in ((prefill, "prefill"), (decode, "decode")):
            beats.append(heartbeat(ctx, router.address, key, encode_message(member.me, hello(member.me, role)), stop))
        wait_for(lambda: router.workers() == {prefill.me, decode.me}, 10, "the members to join")
        rid, result = router.submit([1, 2, 3])
        assert any(env.msg.rid == rid for env in receive_for(decode, 1.0) if hasattr(env.msg, "rid"))  # Admit
        to_router = rogue_sockets(ctx, router.address, key)
        to_decode = rogue_sockets(ctx, decode.me, key)
        forged = [Hello("tcp://127.0.0.1:9", "tcp://127.0.0.1:9", side("prefill"), 4096, 4096),
                  Output(rid, [666], "FORGED", finish_reason="stop", completion_tokens=1),
                  Reject(rid, ErrorInfo(400, "invalid_request_error", "FORGED"), decode.me)]
        for _ in range(20):
            for s in to_router.values():
                for msg in forged:
                    offer(s, encode_message(decode.me, msg))
            for s in to_decode.values():
                offer(s, encode_message(prefill.me, Done(rid, tokens=3, checksum=0, first_token=666)))
            time.sleep(0.05)  # the behaviour under test: outsiders keep knocking for a second
        assert receive_for(decode, 0.5) == []  # the forged Done never reached the decode worker
        assert router.workers() == {prefill.me, decode.me}
        assert not result.done(), result.result()
        member = connect_push(ctx, router.address, key)  # positive control: a holder of the key is believed
        member.send(encode_message(decode.me, Output(rid, [7], "seven", finish_reason="stop", completion_tokens=1)))
        assert result.result(5)[:2] == ([7], "seven")
    finally:
        stop.set()
        for beat in beats:  # their sockets closed before the context is destroyed
            beat.join(5)
        ctx.destroy(linger=0)
        router.close()
        prefill.close()
        decode.close()


@pytest.mark.fast
def test_an_idle_router_polls_its_inbox_rarely_and_the_first_request_brings_back_the_short_poll():
    """The inbox wakes the router's receive loop; its safety-net poll runs every POLL_S only while requests run.
    Before, it ran every 10 ms always: an idle router took 2.9% of a core, 0.7% after (2026-12-07, AMD EPYC)."""
    router = Router(None)
    polls = [0]
    receive = router.engine.channel.receive

    def counted(timeout_ms: int) -> list:
        polls[0] += 1
        return receive(timeout_ms)

    try:
        router.call(lambda: setattr(router.engine.channel, "receive", counted))
        time.sleep(1.0)
        idle = polls[0]
        _, waiting = router.submit([1, 2, 3])  # no worker joined: it waits in the router's queue, in flight still
        time.sleep(1.0)
        running = polls[0] - idle
        assert router.call(lambda: len(router.engine._sinks)) == 1  # still waiting, not refused
        waiting.cancel()
    finally:
        router.close()
    assert idle <= 12, f"{idle} polls in an idle second"  # 4 of the idle poll, 2 of the watch, ~100 before
    assert running >= 25, f"{running} polls in a second with a request waiting"  # ~100 at one per 10 ms


# ---------------------------------------------------------------------------- real worker processes


def start_worker(role: str, router: str, log: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    from tests.tiny_models import tiny_model_dir

    args = [role, "--router", router, "--bind", free_tcp_address(), "--transfer", "shm", "--model",
            str(tiny_model_dir("llama")), "--max-context", "4096", "--kv-pool-tokens", "16384", *extra]
    return subprocess.Popen([sys.executable, "-m", "kvfence.cli", *args], cwd=ROOT, start_new_session=True,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            env={**{k: v for k, v in os.environ.items() if k != "KVFENCE_CLUSTER_KEY"}, **(env or {})})


@pytest.mark.slow
def test_rogue_worker_processes_never_join_and_receive_no_prompt(tmp_path, caplog):
    """Real ``kvfence prefill``/``decode`` processes: members with the key join and serve; a prefill worker with no
    key and a decode worker with another cluster's key start, keep trying, say why they cannot join, and are never
    listed, paired or sent anything. The router logs the refusals."""
    key_file, other_file = tmp_path / "cluster.key", tmp_path / "other.key"
    ClusterKey.generate().write(key_file)
    ClusterKey.generate().write(other_file)
    caplog.set_level(logging.WARNING, logger="kvfence.channel")
    router = Router(ClusterKey.load(key_file))
    logs = {name: tmp_path / f"{name}.log" for name in ("prefill", "decode", "keyless", "stranger")}
    procs = {
        "prefill": start_worker("prefill", router.address, logs["prefill"], "--cluster-key", str(key_file)),
        "decode": start_worker("decode", router.address, logs["decode"], env={"KVFENCE_CLUSTER_KEY": str(key_file)}),
        "keyless": start_worker("prefill", router.address, logs["keyless"]),
        "stranger": start_worker("decode", router.address, logs["stranger"], "--cluster-key", str(other_file)),
    }
    try:
        def ready(name: str) -> bool:
            assert procs[name].poll() is None, logs[name].read_text()[-3000:]
            return "worker" in logs[name].read_text() and " ready " in logs[name].read_text()

        wait_for(lambda: all(ready(name) for name in procs), 120, "every worker process to start")
        wait_for(lambda: len(router.workers()) == 2, 30, "the members to join")

        def refusals() -> list[str]:
            return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]

        def both_refused() -> bool:  # the rogues' heartbeats knocked, and the router turned each away
            return (any("different cluster keys" in m for m in refusals())  # the stranger
                    and any("no cluster key" in m or "broke off" in m for m in refusals()))  # the keyless one

        def both_told() -> bool:  # and each rogue says why it cannot join (which ZMTP error depends on timing)
            keyless = logs["keyless"].read_text()
            return ("one side has no cluster key" in keyless or "the handshake broke off" in keyless) \
                and "cannot join the router" in logs["stranger"].read_text()

        wait_for(lambda: both_refused() and both_told(), 60, "the router to refuse both rogues, and them to say so")
        for i in range(3):
            ids, text, error = router.submit([100 + i, 200, 300 + i])[1].result(60)
            assert error is None and len(ids) == 8, error
        members = router.workers()
        assert len(members) == 2
        assert set(router.call(lambda: dict(router.engine.assigned))) == members
        assert all(procs[name].poll() is None for name in procs)  # the rogues are still up, still refused
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        router.close()


# ---------------------------------------------------------------------------- what the engines do not fence


@pytest.mark.slow
def test_mooncake_lets_any_process_that_reaches_it_read_and_write_a_limit_kvfence_documents():
    """Mooncake's engine authenticates no peer: a process that never saw the decode worker's descriptor, only its
    engine's host:port (which a port scan finds; it listens on every interface), asks the engine for its buffer's
    address and reads and writes the KV pool. kvfence cannot check this at the target; workers warn at start
    (``WorkerSettings.data_plane_caveat``) and docs/architecture.md says where Mooncake may run. Should Mooncake
    learn to refuse, this test fails and the docs must change."""
    from mooncake.engine import TransferEngine

    from kvfence.config import EngineConfig
    from kvfence.transfer.base import Region
    from kvfence.transfer.harness import TargetProcess
    from kvfence.workers.settings import WorkerSettings

    target = TargetProcess("mooncake", 1 << 20)
    rogue, region = TransferEngine(), Region.anonymous(1 << 20)
    try:
        target.fill(0x5A)
        session = target.descriptor.session
        assert rogue.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert rogue.register_memory(region.address, region.nbytes) == 0
        base = rogue.get_first_buffer_address(session)  # handed out to anyone who asks
        assert base == target.descriptor.base
        assert rogue.transfer_sync_read(session, region.address, base, 4096) == 0
        assert bytes(region.buffer[:4096]) == b"\x5a" * 4096
        region.buffer[:4096] = b"\x66" * 4096
        assert rogue.transfer_sync_write(session, region.address, base, 4096) == 0
        assert target.read(0, 4096) == b"\x66" * 4096
    finally:
        rogue.unregister_memory(region.address)
        target.close()
    for transfer, warned in (("mooncake", True), ("nixl", True), ("tcp", False), ("shm", False)):
        settings = WorkerSettings("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "m", "bfloat16", "cpu",
                                  EngineConfig(64, 64, role="decode"), transfer=transfer)
        assert (settings.data_plane_caveat() is not None) is warned
