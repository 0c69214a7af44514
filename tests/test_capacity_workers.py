"""Capacity isolation inside the workers (issue 19), on a real prefill and a real decode worker (``tests/pair.py``:
production cores, engines, pools and shm data plane) with the tiny model.

- Prefill stops computing a prompt whose client left, or whose handoff decode gave up on, between chunks.
- Prefill's progress keeps a long handoff alive: the timeout measures a stalled handoff, not a long prompt.
- Decode preempts by share and reports it in the last ``Output``, and the preempted request's greedy output is
  the one it gets alone; a real server counts it per tenant.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from kvfence.protocol.capacity import UNGATED
from kvfence.protocol.prefill import PrefillCore
from tests.pair import Pair
from tests.server import Server
from tests.tiny_models import tiny_model_dir

CHUNK = 64  # the pair's chunk size; with step_tokens=64, one chunk a prefill step
LONG = [5 + i % 4000 for i in range(1024)]  # 16 chunks


def chunk_log(pair: Pair) -> list[tuple[int, int]]:
    """Every prompt chunk prefill computes from now on, as (rid, tokens computed so far)."""
    log: list[tuple[int, int]] = []
    runner = pair.prefill.runner
    computed = runner._computed

    def logged(work) -> None:
        log.extend((w.seq.rid, w.end) for w in work)
        computed(work)

    runner._computed = logged
    return log


def assert_released(pair: Pair) -> None:
    """Nothing is left anywhere: no request, every decode page free, prefill's backlog empty."""
    pair.settle()
    assert pair.router.reqs == {} and pair.decode.core.reqs == {} and pair.prefill.core.reqs == {}
    pages = pair.decode.engine.pages
    assert pages.num_free == pages.num_pages and pair.prefill.hello().queued_tokens == 0
    pair.decode.check_integrity()


@pytest.mark.model
@pytest.mark.parametrize("stop", [True, False], ids=["cancel-stops-prefill", "without-cancel"])
def test_prefill_stops_computing_a_prompt_whose_client_left(model, monkeypatch, stop):
    """The client leaves after 3 of 16 chunks. L7 still holds decode's cancel until the handoff ends, but prefill
    hears at once: its backlog drops to zero, not one more chunk is computed, and once its writes drained it ends
    the handoff (Fail to decode, which frees the pages). Without the router's Cancel to prefill (as before), prefill
    computed all 16 chunks for a client that was gone."""
    if not stop:
        monkeypatch.setattr(PrefillCore, "_cancel", lambda self, sender, rid: [])
    pair = Pair(model, max_context=2048, prefill_pool=2048, decode_pool=2048, step_tokens=CHUNK)
    log = chunk_log(pair)
    rid = pair.submit(LONG, max_tokens=4)
    assert pair.step_until(lambda: len(log) >= 3)
    pair.client_gone(rid)
    pair.pump()
    if stop:
        assert pair.prefill.hello().queued_tokens == 0
        computed = len(log)
        assert_released(pair)
        assert len(log) == computed
    else:
        assert_released(pair)
        assert len(log) == len(LONG) // CHUNK


@pytest.mark.slow
@pytest.mark.parametrize("progress", [True, False], ids=["with-progress", "without-progress"])
def test_prefill_progress_keeps_a_long_handoff_alive(model, monkeypatch, progress):
    """A 1,024-token prompt computed one chunk at a time, 0.5 s apart, takes 8 s: four times the 2 s handoff
    timeout. Each chunk's Progress restarts decode's timeout, so the request is served. Without Progress (as before)
    decode gives up after 2 s with a 503, and its Abort stops prefill between chunks."""
    if not progress:
        monkeypatch.setattr(PrefillCore, "progress", lambda self, rid, tokens: [])
    pair = Pair(model, max_context=2048, prefill_pool=2048, decode_pool=2048, step_tokens=CHUNK,
                handoff_timeout=2.0)
    log = chunk_log(pair)
    rid = pair.submit(LONG, max_tokens=4)
    result = pair.results[rid]
    deadline = time.monotonic() + 120
    while not result.ended:
        assert time.monotonic() < deadline
        pair.step()
        time.sleep(0.5)  # the behaviour under test: one chunk per step, 0.5 s apart (see the docstring)
    if progress:
        assert result.finish_reason == "length" and len(result.tokens) == 4
        assert len(log) == len(LONG) // CHUNK
    else:
        assert result.status == 503 and "did not finish the KV transfer in time" in result.error.message
        assert pair.prefill.hello().queued_tokens == 0
        computed = len(log)
        assert_released(pair)
        assert computed == len(log) < len(LONG) // CHUNK


@pytest.mark.model
def test_decode_preempts_the_flooding_tenant_and_reports_it(model):
    """Decode's pool (24 pages of 16 tokens) cannot hold four 16-token prompts growing to 16 + 100 tokens. bob's
    three requests and alice's one are sent at once (the router's reservations off, as for outputs beyond them):
    decode preempts only bob's, recomputes them itself, and each last Output says how often; every output equals
    the request's output alone."""
    pair = Pair(model, max_context=384, prefill_pool=2048, decode_pool=384, limits=UNGATED)
    prompts = {tenant: [[300 + 11 * n + i for i in range(16)] for n in range(count)]
               for tenant, count in (("bob", 3), ("alice", 1))}
    rids = {pair.submit(p, max_tokens=100, tenant=t): (t, p) for t in ("bob", "alice") for p in prompts[t]}
    pair.run()
    by_tenant = {t: [pair.results[r].preemptions for r, (tt, _) in rids.items() if tt == t] for t in prompts}
    assert by_tenant["alice"] == [0] and sum(by_tenant["bob"]) >= 1
    alone = Pair(model, max_context=384, prefill_pool=2048, decode_pool=2048)
    for rid, (_, prompt) in rids.items():
        ref = alone.submit(prompt, max_tokens=100)
        alone.run([ref])
        assert pair.results[rid].tokens == alone.results[ref].tokens and alone.results[ref].preemptions == 0
    assert_released(pair)


@pytest.mark.slow
def test_a_real_server_counts_decodes_preemptions_per_tenant(tmp_path):
    """``kvfence serve`` with a 70-page pool: the router reserves 528 tokens (prompt + 512) for each of bob's two
    600-token generations, so both go, and they outgrow the pool at decode. Decode preempts one, recomputes it,
    both finish whole, and ``kvfence_preemptions_total{tenant="bob"}`` counts it (from ``Output.preemptions``)."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.bob]\napi_keys = ["sk-bob"]\n\n[admin]\napi_keys = ["sk-admin"]\n')
    with Server("--model", str(tiny_model_dir("llama")), "--max-context", "640", "--kv-pool-tokens", "1120",
                "--tenants", str(tenants)) as server:
        bob = server.async_client("sk-bob", timeout=300)

        async def generate(n: int) -> int:
            model = (await bob.models.list()).data[0].id
            reply = await bob.completions.create(model=model, prompt=[300 + 11 * n + i for i in range(16)],
                                                 temperature=0, max_tokens=600, extra_body={"ignore_eos": True})
            return reply.usage.completion_tokens

        async def both() -> list[int]:
            return await asyncio.gather(generate(0), generate(1))

        assert asyncio.run(both()) == [600, 600]
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer sk-admin"}, timeout=10).text
    counted = re.search(r'kvfence_preemptions_total\{tenant="bob"\} (\S+)', metrics)
    assert counted is not None and float(counted[1]) >= 1, metrics[-2000:]
