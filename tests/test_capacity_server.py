"""Capacity isolation on a real ``kvfence serve`` (tiny model): one tenant floods, another's first tokens stay fast.

The decode pool (2,048 tokens) holds four of bob's requests at once (each reserves its 210-token prompt and
150 to 250 output tokens), so bob's sixteen streams keep about twelve requests waiting in the router's queue.
alice's short chats, one at a time, leave the queue as soon as one of bob's requests ends; behind first come,
first served (``--scheduling fcfs``), they wait for three rounds of bob's, longer than bob's own median.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import time

import httpx
import openai
import pytest

from tests.server import Server
from tests.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


TENANTS = '[tenants.alice]\napi_keys = ["sk-alice"]\n\n[tenants.bob]\napi_keys = ["sk-bob"]\n'
FLOOD_STREAMS = 16


async def first_token_time(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int,
                           waited: list[float] | None = None) -> float:
    """Seconds to the first streamed chunk (sent with the first token), having read the stream to its end. Cancelled
    before its first token, it appends the time it had waited so far to ``waited`` (a lower bound)."""
    t0 = time.monotonic()
    first = None
    try:
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=max_tokens, stream=True, temperature=0,
                                                      extra_body={"ignore_eos": True})
        async for _ in stream:
            first = first or time.monotonic()
    except asyncio.CancelledError:
        if first is None and waited is not None:
            waited.append(time.monotonic() - t0)
        raise
    return (first or time.monotonic()) - t0


async def flood_and_chat(server: Server) -> tuple[list[float], list[float], list[int]]:
    """(bob's TTFTs once his queue had formed, alice's TTFTs, error statuses). A request of bob's still waiting
    at the end counts with the time it had waited."""
    # Closed on this loop: left to the garbage collector they would close on a later test's (closed) loop.
    async with server.async_client("sk-bob", timeout=120) as bob, \
            server.async_client("sk-alice", timeout=120) as alice:
        return await _flood_and_chat(bob, alice)


async def _flood_and_chat(bob: openai.AsyncOpenAI, alice: openai.AsyncOpenAI) -> tuple[list[float], list[float],
                                                                                       list[int]]:
    model = (await alice.models.list()).data[0].id
    long_prompt = "hello " * 200  # about 210 tokens with the chat template
    await first_token_time(alice, model, "Warm up.", 4)  # the first forward passes are slow
    bob_ttft: list[float] = []
    alice_ttft: list[float] = []
    errors: list[int] = []
    queue_formed = time.monotonic() + 3.0

    async def flood(max_tokens: int) -> None:
        while True:
            late = time.monotonic() > queue_formed
            try:
                ttft = await first_token_time(bob, model, long_prompt, max_tokens, bob_ttft if late else None)
            except openai.APIStatusError as e:
                errors.append(e.status_code)
                return
            if late:
                bob_ttft.append(ttft)

    floods = [asyncio.create_task(flood(150 + 25 * (i % 5))) for i in range(FLOOD_STREAMS)]  # ends spread out
    await asyncio.sleep(queue_formed - time.monotonic())  # the workload: 3 s of bob's flood before alice starts
    deadline = time.monotonic() + 60
    i = 0  # ten chats of alice's, and on until bob has eight first tokens (a fast host serves alice quickly)
    while i < 10 or (len(bob_ttft) < 8 and time.monotonic() < deadline):
        try:
            alice_ttft.append(await first_token_time(alice, model, f"Say hello number {i}.", 4))
        except openai.APIStatusError as e:
            errors.append(e.status_code)
        i += 1
        await asyncio.sleep(0.5)  # the workload: alice is a light user, one chat every half second
    for task in floods:  # bob's clients leave, queued or streaming
        task.cancel()
    await asyncio.gather(*floods, return_exceptions=True)
    return bob_ttft, alice_ttft, errors


@pytest.mark.parametrize("scheduling", ["fair"])
def test_a_flooding_tenant_does_not_queue_another_tenant_behind_it(tmp_path, scheduling):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    with Server("--model", str(tiny_model_dir("llama")), "--max-context", "512", "--kv-pool-tokens", "2048",
                "--tenants", str(tenants), "--scheduling", scheduling) as server:
        bob, alice, errors = asyncio.run(flood_and_chat(server))
    assert errors == []  # overload queues: no 503, and no 429 without quotas
    assert len(alice) >= 10 and len(bob) >= 8
    alice_median, bob_median = statistics.median(alice), statistics.median(bob)
    assert alice_median < 0.4 * bob_median, (alice, bob)  # fcfs: about 1.2x


def test_a_request_sent_while_the_decode_worker_restarts_waits_for_it_instead_of_failing(tmp_path):
    """Kill the decode worker; once the router has noticed, send a request: it waits in the queue for the
    restarted worker (within --worker-grace) and is answered 200, where it used to get 503 at once."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS + '\n[admin]\napi_keys = ["sk-admin"]\n')
    admin = {"Authorization": "Bearer sk-admin"}
    with Server("--model", str(tiny_model_dir("llama")), "--max-context", "512", "--kv-pool-tokens", "2048",
                "--tenants", str(tenants)) as server:
        alice = server.client("sk-alice", timeout=120)
        model = alice.models.list().data[0].id
        detail = httpx.get(server.url + "/health", headers=admin, timeout=10).json()
        [decode_pid] = [w["pid"] for w in detail["workers"].values() if w["role"] == "decode"]
        os.kill(decode_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(w["role"] == "decode" for w in httpx.get(server.url + "/health", headers=admin,
                                                            timeout=10).json()["workers"].values()):
            assert time.monotonic() < deadline, "the router did not notice the dead decode worker"
            time.sleep(0.02)
        t0 = time.monotonic()
        answer = alice.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, extra_body={"ignore_eos": True})
        waited = time.monotonic() - t0
        metrics = httpx.get(server.url + "/metrics", headers=admin, timeout=10).text
    assert answer.usage.completion_tokens == 4
    assert waited > 0.3  # it did wait for the new worker
    assert 'kvfence_queue_time_seconds_count{tenant="alice"} 1.0' in metrics
    queued = re.search(r'kvfence_queue_time_seconds_sum\{tenant="alice"\} (\S+)', metrics)
    assert 0.3 < float(queued[1]) <= waited  # in the router's queue, not in a dead worker's
