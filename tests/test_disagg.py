"""Disaggregated serving through real processes, on a tiny random-weight Llama for speed.

Every data plane must give exactly the colocated engine's greedy tokens; several workers share load; a worker
killed with SIGKILL costs its in-flight requests a clear 503 within seconds and nothing else.
"""

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
import zmq

from tests.server import Server
from tests.tiny_models import tiny_model_dir

PROMPTS = [f"Prompt number {i}: tell me about topic {i * 7}." for i in range(7)]
PROMPTS.append(" ".join(f"w{i}" for i in range(700)))  # spans two 512-token chunks: a chunked, overlapped transfer
COMMON = ("--max-context", "4096", "--kv-pool-tokens", "16384")  # the tiny model's whole context


def completion(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 16) -> str:
    reply = client.completions.create(model="llama", prompt=prompt, temperature=0, max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True})
    return reply.choices[0].text


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def reference(model):
    with Server("--mode", "colocated", "--model", model, *COMMON) as server:
        client = server.client()
        yield {p: completion(client, p) for p in PROMPTS}


@pytest.mark.parametrize("transfer", ["shm", "tcp", "mooncake", "nixl"])
def test_every_data_plane_matches_colocated(model, reference, transfer):
    with Server("--model", model, "--transfer", transfer, *COMMON) as server:
        client = server.client()
        assert {p: completion(client, p) for p in PROMPTS} == reference


def test_prompt_up_to_the_full_context(model):
    prompt = [1000 + (i * 7919) % 40000 for i in range(4090)]  # token ids: 8 chunks, 6 tokens short of the context
    with Server("--mode", "colocated", "--model", model, *COMMON) as colocated:
        want = completion(colocated.client(), prompt, max_tokens=4)
    with Server("--model", model, *COMMON) as server:
        client = server.client()
        assert completion(client, prompt, max_tokens=4) == want


@pytest.fixture(scope="module")
def four_workers(model):
    with Server("--model", model, "--prefill", "2", "--decode", "2", *COMMON) as server:
        deadline = time.monotonic() + 60
        while len(server.health()["workers"]) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        yield server


def workers(server: Server, role: str) -> dict[str, dict]:
    return {w: info for w, info in server.health()["workers"].items() if info["role"] == role}


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


def test_killed_decode_worker_fails_its_requests_fast_and_comes_back(four_workers):
    started: set[int] = set()
    victim: dict[str, object] = {}

    async def long_stream(client, i: int):
        """Returns (outcome, when it ended)."""
        try:
            out = await client.completions.create(model="llama", prompt=f"story {i}", max_tokens=4000, stream=True,
                                                  extra_body={"ignore_eos": True})
            async for _ in out:
                started.add(i)
            return "finished", time.monotonic()
        except openai.APIError as exc:
            return exc, time.monotonic()

    async def run():
        async with four_workers.async_client(timeout=60) as client:
            tasks = [asyncio.create_task(long_stream(client, i)) for i in range(6)]
            while len(started) < len(tasks):  # kill as soon as every stream has its first token
                assert not any(t.done() for t in tasks), "a stream ended before all had started"
                await asyncio.sleep(0.02)
            assert not any(t.done() for t in tasks), "a stream ended before the kill"
            # the decode worker holding the most streams (balancing by free pages may put them all on one)
            decodes = await asyncio.to_thread(workers, four_workers, "decode")
            victim["id"] = max(decodes, key=lambda w: decodes[w]["in_flight"])
            victim["pid"] = decodes[victim["id"]]["pid"]
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


def test_malformed_control_messages_are_dropped_not_fatal(four_workers):
    worker, info = next(iter(workers(four_workers, "prefill").items()))
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(worker)
    for junk in (b"", b"\x00\xff garbage", b'{"sender":"x","msg":{"type":"Nope","rid":1}}',
                 b'{"sender":"x","msg":{"type":"Dest","rid":"not-an-int"}}', b'{"sender":"x"'):
        sock.send(junk)
    sock.close()
    time.sleep(1)
    assert workers(four_workers, "prefill")[worker]["pid"] == info["pid"]
    assert httpx.get(four_workers.url + "/health").status_code == 200
    for i in range(4):  # both prefill workers still serve
        assert completion(four_workers.client(), f"still alive {i}")
