"""Faults through real processes (issue 19): a killed prefill worker spares the streams whose KV has landed; a
paused worker is suspected, then fenced, and when it resumes it drops what it held and serves again; a request with
no token yet is retried on another pair. The cores alone: tests/test_fencing.py.
"""

import asyncio
import concurrent.futures
import os
import signal
import time
from collections.abc import Callable
from urllib.parse import quote

import httpx
import openai
import pytest

from tests.server import Server

pytestmark = pytest.mark.slow


COMMON = ("--max-context", "4096", "--kv-pool-tokens", "16384")


def serve(model: str, prefill: int, decode: int, *args: str, slow_step: float = 0.01) -> Server:
    """Every worker joined; decode steps paced (KVFENCE_FAULTS slow_step) so that streams outlive a kill or a
    pause."""
    server = Server("--model", model, "--prefill", str(prefill), "--decode", str(decode), *COMMON, *args,
                    admin=True, env={"KVFENCE_FAULTS": f"slow_step={slow_step}"})
    try:
        wait_for("every worker", lambda: len(server.health()["workers"]) == prefill + decode)
    except BaseException:
        server.stop()
        raise
    return server


def workers(server: Server, role: str) -> dict[str, dict]:
    return {w: info for w, info in server.health()["workers"].items() if info["role"] == role}


def wait_for(what: str, ready: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        time.sleep(0.2)


async def stream(client: openai.AsyncOpenAI, i: int, max_tokens: int, started: set[int]) -> tuple[object, int]:
    """(``"finished"`` or the error, tokens received)."""
    tokens = 0
    try:
        out = await client.completions.create(model="llama", prompt=f"story {i}", max_tokens=max_tokens,
                                              stream=True, extra_body={"ignore_eos": True})
        async for chunk in out:
            tokens += len(chunk.choices[0].text) > 0 if chunk.choices else 0
            started.add(i)
        return "finished", tokens
    except openai.APIError as exc:
        return exc, tokens


async def streams_started(client: openai.AsyncOpenAI, n: int, max_tokens: int, started: set[int]) -> list:
    """``n`` streams (tasks of ``stream``), returned once every one has its first token."""
    tasks = [asyncio.create_task(stream(client, i, max_tokens, started)) for i in range(n)]
    while len(started) < n:
        assert not any(t.done() for t in tasks), "a stream ended before all had started"
        await asyncio.sleep(0.02)
    return tasks


def completion(server: Server, prompt: str) -> str:
    reply = server.client(timeout=60).completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0,
                                                         extra_body={"ignore_eos": True})
    return reply.choices[0].text


def test_a_killed_prefill_worker_spares_the_streams_whose_kv_has_landed(model):
    """Before: killing the prefill worker failed every request it had ever handed off, streams included."""
    with serve(model, 1, 1) as server:
        [(prefill, info)] = workers(server, "prefill").items()
        started: set[int] = set()

        async def run():
            async with server.async_client(timeout=120) as client:
                tasks = await streams_started(client, 4, 300, started)
                os.kill(info["pid"], signal.SIGKILL)
                return await asyncio.gather(*tasks)

        results = asyncio.run(run())
        assert [outcome for outcome, _ in results] == ["finished"] * 4
        wait_for("the prefill worker's restart", lambda: workers(server, "prefill").get(prefill, {}).get("pid")
                 not in (None, info["pid"]))
        assert completion(server, "after the crash")


def admin(server: Server, worker: str, action: str) -> None:
    """Drain or undrain ``worker`` through the admin API."""
    resp = httpx.post(f"{server.url}/admin/workers/{quote(worker, safe='')}/{action}",
                      headers={"Authorization": f"Bearer {server.admin_key}"}, timeout=30)
    assert resp.status_code == 200, resp.text


def test_a_request_on_a_paused_prefill_worker_is_retried_on_another_and_the_worker_comes_back_clean(model):
    """The paused prefill worker holds a request with no token yet (the other one is drained until then): once it
    is declared dead the request goes to the other prefill worker and succeeds. Resumed, the worker learns it was
    fenced, stops, answers decode for the pages it was given (decode kept them quarantined meanwhile, L6) and
    rejoins under epoch 1."""
    with serve(model, 2, 1, "--worker-timeout", "5") as server:
        prefills = workers(server, "prefill")
        paused, other = sorted(prefills)
        admin(server, other, "drain")
        os.kill(prefills[paused]["pid"], signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(completion, server, "who answers this?")
                wait_for("the request to reach the paused worker",
                         lambda: workers(server, "prefill")[paused]["in_flight"] == 1, 30)
                admin(server, other, "undrain")
                assert answer.result(120)
            assert server.health()["workers"].get(paused) is None  # declared dead
            assert [workers(server, "prefill")[other]["assigned"]] == [1]  # the retry
            [decode] = workers(server, "decode").values()
            assert decode["assigned"] == 2  # the first attempt and the retry
        finally:
            os.kill(prefills[paused]["pid"], signal.SIGCONT)
        wait_for("the paused worker to rejoin", lambda: workers(server, "prefill").get(paused, {}).get("epoch") == 1)
        assert workers(server, "prefill")[paused]["pid"] == prefills[paused]["pid"]  # the same process, fenced
        wait_for("decode to free what it kept for the fenced writer",
                 lambda: next(iter(workers(server, "decode").values()))["quarantined_pages"] == 0)
        assert all(completion(server, f"again {i}") for i in range(3))
        assert server.health()["stale_messages"] > 0


def test_a_paused_decode_worker_is_suspected_then_fenced_and_never_streams_for_its_old_clients(model):
    """Before: the router declared a paused decode worker dead after 5 s, and after SIGCONT it kept decoding the
    requests it had held (their clients long gone) while new requests waited behind them."""
    with serve(model, 1, 2, "--worker-timeout", "6", slow_step=0.02) as server:
        started: set[int] = set()
        victim: dict[str, object] = {}

        async def run():
            async with server.async_client(timeout=120) as client:
                tasks = await streams_started(client, 6, 1500, started)
                decodes = await asyncio.to_thread(workers, server, "decode")
                victim["id"] = max(decodes, key=lambda w: decodes[w]["in_flight"])
                victim["pid"] = decodes[victim["id"]]["pid"]
                os.kill(victim["pid"], signal.SIGSTOP)
                await asyncio.to_thread(wait_for, "suspicion",
                                        lambda: workers(server, "decode")[victim["id"]]["suspected"], 10)
                victim["meanwhile"] = await asyncio.to_thread(completion, server, "while it is quiet")
                await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
                await asyncio.sleep(1)  # the victim's streams fail together; the others stream on (~30 s more)
                going = [t for t in tasks if not t.done()]
                for t in going:
                    t.cancel()
                return [t.result() for t in tasks if t not in going], len(going)

        try:
            ended, streaming = asyncio.run(run())
        finally:
            os.kill(victim["pid"], signal.SIGCONT)
        assert victim["meanwhile"]  # the suspected worker got no new request; the other served it
        failed = [err for err, _ in ended if err != "finished"]
        assert failed and len(failed) == len(ended), ended  # the paused worker's streams, and no other, ended
        assert streaming, "the other worker's streams go on"
        assert all(isinstance(err, openai.APIError) and "died" in str(err) for err in failed), failed
        wait_for("the paused worker to rejoin", lambda: workers(server, "decode").get(victim["id"], {}).get("epoch")
                 == 1, 30)
        back = workers(server, "decode")[victim["id"]]
        assert back["pid"] == victim["pid"]
        # It dropped the requests it held: nothing runs there and its pages came back, long before the 1,500-token
        # streams could have ended (~30 s at 20 ms a step).
        wait_for("the fenced worker's pages", lambda: (lambda d: d["running"] == 0
                 and d["free_pages"] == d["total_pages"])(workers(server, "decode")[victim["id"]]), 10)
        assert server.health()["stale_messages"] > 0  # what it sent under its old epoch was dropped
        before = back["assigned"]
        for i in range(4):
            assert completion(server, f"after {i}")
        assert workers(server, "decode")[victim["id"]]["assigned"] > before  # it serves again
