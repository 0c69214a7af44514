"""Disaggregated serving through real processes, on a tiny random-weight Llama for speed.

Every data plane must give exactly the colocated engine's greedy tokens; several workers share load; a worker
killed with SIGKILL costs its in-flight requests a clear 503 within seconds and nothing else.
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import zmq

from tests.server import ROOT, Server, free_port, wait_until

PROMPTS = [f"Prompt number {i}: tell me about topic {i * 7}." for i in range(7)]
PROMPTS.append(" ".join(f"w{i}" for i in range(700)))  # spans two 512-token chunks: a chunked, overlapped transfer
COMMON = ("--max-context", "4096", "--kv-pool-tokens", "16384")  # the tiny model's whole context


def completion(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 16) -> str:
    reply = client.completions.create(model="llama", prompt=prompt, temperature=0, max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True})
    return reply.choices[0].text


@pytest.fixture(scope="module")
def reference(model):
    with Server("--mode", "colocated", "--model", model, *COMMON) as server:
        client = server.client()
        yield {p: completion(client, p) for p in PROMPTS}


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["shm", "tcp", "mooncake", "nixl"])
def test_every_data_plane_matches_colocated(model, reference, transfer):
    with Server("--model", model, "--transfer", transfer, *COMMON) as server:
        client = server.client()
        assert {p: completion(client, p) for p in PROMPTS} == reference


@pytest.mark.slow
def test_prompt_up_to_the_full_context(model):
    prompt = [1000 + (i * 7919) % 40000 for i in range(4090)]  # token ids: 8 chunks, 6 tokens short of the context
    with Server("--mode", "colocated", "--model", model, *COMMON) as colocated:
        want = completion(colocated.client(), prompt, max_tokens=4)
    with Server("--model", model, *COMMON) as server:
        client = server.client()
        assert completion(client, prompt, max_tokens=4) == want


@pytest.fixture(scope="module")
def cluster_key(tmp_path_factory) -> Path:
    """A key file for deployments whose control plane a test talks to as a member."""
    from kvfence.cluster import ClusterKey

    path = tmp_path_factory.mktemp("cluster") / "cluster.key"
    ClusterKey.generate().write(path)
    return path


@pytest.fixture(scope="module")
def four_workers(model, cluster_key):
    # Decode steps paced at >= 5 ms: the tiny model would otherwise finish a stream before a test can kill its worker.
    with Server("--model", model, "--prefill", "2", "--decode", "2", "--cluster-key", str(cluster_key),
                *COMMON, admin=True, env={"KVFENCE_FAULTS": "slow_step=0.005"}) as server:
        wait_until(lambda: len(server.health()["workers"]) == 4, 60, "all four workers to join")
        yield server


def workers(server: Server, role: str) -> dict[str, dict]:
    return {w: info for w, info in server.health()["workers"].items() if info["role"] == role}


@pytest.mark.slow
def test_workers_report_their_cpu_capabilities_in_the_health_detail(model, four_workers):
    """Each worker's Hello carries what its model computes with (its backend and ``kernels.detect()``; the workers
    inherit this process's environment, so the same host and overrides), and the colocated engine's health says the
    same."""
    from kvfence.model import kernels

    caps = kernels.detect()
    want = {"cpu": caps.summary(), "backend": f"c-{caps.flavour}" if caps.flavour else "torch"}
    for info in four_workers.health()["workers"].values():
        assert {k: info[k] for k in want} == want
    with Server("--mode", "colocated", "--model", model, *COMMON, admin=True) as colocated:
        assert {k: colocated.health()[k] for k in want} == want


@pytest.mark.slow
def test_load_is_spread_and_streams_arrive_in_order(four_workers):
    async def stream(client, i: int) -> list[str]:
        out = await client.completions.create(model="llama", prompt=f"count {i}", max_tokens=24, stream=True,
                                              temperature=0, extra_body={"ignore_eos": True})
        return [c.choices[0].text async for c in out]

    async def run():
        async with four_workers.async_client() as client:  # closed on this loop, not GC'd on a later one
            return await asyncio.gather(*(stream(client, i) for i in range(8)))

    results = asyncio.run(run())
    sync = four_workers.client()
    for i, chunks in enumerate(results):
        assert "".join(chunks) == completion(sync, f"count {i}", max_tokens=24)
    for role in ("prefill", "decode"):
        assert all(info["assigned"] > 0 for info in workers(four_workers, role).values()), role


@pytest.mark.slow
def test_killed_decode_worker_fails_its_requests_fast_and_comes_back(four_workers):
    started: set[int] = set()
    victim: dict[str, object] = {}

    async def long_stream(client, i: int):
        """Returns (outcome, when it ended)."""
        try:
            out = await client.completions.create(model="llama", prompt=f"story {i}", max_tokens=1500, stream=True,
                                                  extra_body={"ignore_eos": True})
            async for _ in out:
                started.add(i)
            return "finished", time.monotonic()
        except openai.APIError as exc:
            return exc, time.monotonic()

    async def run():
        async with four_workers.async_client(timeout=60) as client:
            tasks = [asyncio.create_task(long_stream(client, i)) for i in range(6)]
            # The victim: the decode worker holding the most streams (balancing by free pages may put them all on
            # one), read as soon as all are placed. Once they stream, the router is too busy for a prompt answer.
            while True:
                decodes = await asyncio.to_thread(workers, four_workers, "decode")
                if sum(d["in_flight"] for d in decodes.values()) == len(tasks):
                    break
                assert not any(t.done() for t in tasks), "a stream ended before all were placed"
            victim["id"] = max(decodes, key=lambda w: decodes[w]["in_flight"])
            victim["pid"] = decodes[victim["id"]]["pid"]
            while len(started) < len(tasks):  # kill as soon as every stream has its first token
                assert not any(t.done() for t in tasks), "a stream ended before all had started"
                await asyncio.sleep(0.02)
            assert not any(t.done() for t in tasks), "a stream ended before the kill"
            os.kill(victim["pid"], signal.SIGKILL)
            return time.monotonic(), await asyncio.gather(*tasks)

    killed_at, results = asyncio.run(run())
    failed = [(err, ended - killed_at) for err, ended in results if err != "finished"]
    assert failed, "some requests must have been on the killed worker"
    for err, after in failed:
        assert after < 10, f"a request on the dead worker took {after:.1f}s to fail"
        assert "died" in str(err), err
    # new requests go to live workers, and the supervisor restarts the dead one
    assert completion(four_workers.client(), "after the crash") is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        decodes = workers(four_workers, "decode")
        if victim["id"] in decodes and decodes[victim["id"]]["pid"] != victim["pid"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail("killed decode worker was not restarted")


@pytest.mark.slow
def test_malformed_control_messages_are_dropped_not_fatal(four_workers, cluster_key):
    """Junk from a member of the cluster (outsiders do not get through at all: tests/test_cluster.py)."""
    from kvfence.channel import connect_push
    from kvfence.cluster import ClusterKey

    worker, info = next(iter(workers(four_workers, "prefill").items()))
    dropped = f"prefill[{info['pid']}] kvfence.channel: dropped a malformed control message"

    def drops() -> int:  # the worker's own log line for each frame its inbox read and could not decode
        return four_workers.log_text().count(dropped)

    before = drops()
    junks = (b"", b"\x00\xff garbage", b'{"sender":"x","msg":{"type":"Nope","rid":1}}',
             b'{"sender":"x","msg":{"type":"Dest","rid":"not-an-int"}}', b'{"sender":"x"')
    sock = connect_push(zmq.Context.instance(), worker, ClusterKey.load(cluster_key))
    sock.setsockopt(zmq.LINGER, 1000)
    for junk in junks:
        sock.send(junk)
    sock.close()
    wait_until(lambda: drops() == before + len(junks), 30, "the prefill worker to read and drop every junk frame")
    assert workers(four_workers, "prefill")[worker]["pid"] == info["pid"]
    assert httpx.get(four_workers.url + "/health").status_code == 200
    for i in range(4):  # both prefill workers still serve
        assert completion(four_workers.client(), f"still alive {i}")


@pytest.mark.fast
def test_data_plane_addresses_follow_the_workers_control_addresses():
    from kvfence.config import EngineConfig
    from kvfence.workers.settings import WorkerSettings

    def options(transfer: str, side: str, bind: str, advertise: str | None = None) -> dict:
        settings = WorkerSettings(bind, "tcp://10.0.0.1:5550", "m", "bf16", "cpu", EngineConfig(64, 64, role="decode"),
                                  transfer=transfer, advertise=advertise)
        return settings.data_plane_options(side)

    one_host = [("tcp://127.0.0.1:5551", None), ("ipc:///tmp/w", None), ("tcp://localhost:1", None)]
    for transfer in ("shm", "tcp", "mooncake", "nixl"):
        for bind, advertise in one_host:
            assert options(transfer, "target", bind, advertise) == {}
    assert options("tcp", "target", "tcp://0.0.0.0:5551", "tcp://10.0.0.2:5551") == {"host": "0.0.0.0",
                                                                                       "advertise": "10.0.0.2"}
    assert options("tcp", "target", "tcp://10.0.0.2:5551") == {"host": "10.0.0.2", "advertise": None}
    assert options("tcp", "initiator", "tcp://0.0.0.0:5551", "tcp://10.0.0.1:5551") == {}
    for side in ("target", "initiator"):
        assert options("mooncake", side, "tcp://*:5551", "tcp://[fd00::2]:5551") == {"hostname": "fd00::2"}
        assert options("nixl", side, "tcp://0.0.0.0:5551", "tcp://10.0.0.2:5551") == {}


def non_loopback_address() -> str | None:
    """This host's address on its default route (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def listening_addresses(pid: int) -> set[str]:
    """The local IPv4 addresses on which process ``pid`` has listening TCP sockets (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(fields[1].split(":")[0])[::-1]))
    return found


@pytest.mark.slow
def test_readme_several_hosts_commands_serve_beyond_loopback(model, reference, tmp_path):
    """The README's "Several hosts" commands, one process per role, on this host's non-loopback address, with a
    cluster key made by `kvfence cluster-key`. The output equals colocated serving (over the tcp data plane sealed,
    as beyond loopback), and the decode worker listens for KV only on that interface or all of them: its tcp data
    plane used to bind 127.0.0.1, which a prefill worker on another host cannot reach."""
    ip = non_loopback_address()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address here")
    key = tmp_path / "cluster.key"
    subprocess.run([sys.executable, "-m", "kvfence.cli", "cluster-key", str(key)], cwd=ROOT, check=True)
    router, prefill, decode, http = (free_port() for _ in range(4))
    common = ["--model", model, *COMMON[:2], "--cluster-key", str(key)]
    worker = [*common, "--kv-pool-tokens", COMMON[3], "--router", f"tcp://{ip}:{router}", "--transfer", "tcp"]
    commands = {
        "router": ["router", "--bind", f"tcp://0.0.0.0:{router}", "--advertise", f"tcp://{ip}:{router}",
                   "--port", str(http), "--host", "0.0.0.0", *common],
        "prefill": ["prefill", "--bind", f"tcp://0.0.0.0:{prefill}", "--advertise", f"tcp://{ip}:{prefill}", *worker],
        "decode": ["decode", "--bind", f"tcp://0.0.0.0:{decode}", "--advertise", f"tcp://{ip}:{decode}", *worker],
    }
    procs = {role: subprocess.Popen([sys.executable, "-m", "kvfence.cli", *args], cwd=ROOT, start_new_session=True,
                                    stdout=open(tmp_path / f"{role}.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
             for role, args in commands.items()}
    try:
        url = f"http://{ip}:{http}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs.values()), {r: (tmp_path / f"{r}.log").read_text()[-2000:]
                                                                   for r in procs}
            try:
                if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail("the three processes did not become ready")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert {p: completion(client, p) for p in PROMPTS[:3]} == {p: reference[p] for p in PROMPTS[:3]}
        listening = listening_addresses(procs["decode"].pid)
        assert listening and "127.0.0.1" not in listening, listening
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
