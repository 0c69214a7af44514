"""Per-layer proof: for each safety layer, the fault it stops, the harm with it off, the clean error with it on.

Every case runs the real workers (tests/pair.py: real engines, pools, page tags and shm data plane) with layers
switched off only through ``KVFENCE_UNSAFE``, except L3's check before every decode step, which runs on a
decode-side engine directly (its switch then comes as ``Safety``). Where other layers would also stop a fault
(defence in depth), they are switched off too, so the layer under test is the only one left; each test's
docstring says which.
L0 (preflight) is proved through the CLI, in tests/test_incident.py and here.
"""

import os
import subprocess
import sys

import numpy as np
import openai
import pytest
import torch

from kvfence.config import EngineConfig
from kvfence.core import FinishReason, Request, RequestOutput, SamplingParams
from kvfence.engine.engine import Engine
from kvfence.kvcache import pages
from kvfence.model.loader import load_model
from kvfence.safety import Safety
from tests.pair import Pair
from tests.server import ROOT, Server

PAGE = 16
OVER_LENGTH = [5 + i % 97 for i in range(40)]  # over the 32-token prefill pool of `incident_pair`
SHORT = [7 + i % 89 for i in range(30)]
VICTIM = [11 + i % 83 for i in range(32)]  # fills the decode pool's pages that OVER_LENGTH will be granted


def pair_with(monkeypatch, model: str, unsafe: str, **kw) -> Pair:
    if unsafe:
        monkeypatch.setenv("KVFENCE_UNSAFE", unsafe)
    else:
        monkeypatch.delenv("KVFENCE_UNSAFE", raising=False)
    return Pair(model, **kw)


def incident_pair(monkeypatch, model: str, unsafe: str) -> Pair:
    """The incident's shape: a prefill pool (32 tokens) under the context (64), placeholder emulation on,
    and a decode pool of exactly 3 pages, so the over-length request is granted the victim's freed pages."""
    return pair_with(monkeypatch, model, unsafe, max_context=64, prefill_pool=32, decode_pool=3 * PAGE,
                     emulate_incident=True)


def victim_then_attacker(pair: Pair):
    victim = pair.submit(VICTIM, max_tokens=8)
    pair.run([victim])
    assert pair.results[victim].status == 200
    attacker = pair.submit(OVER_LENGTH, max_tokens=4)
    pair.run([attacker])
    return pair.results[attacker]


def assert_clean(pair: Pair) -> None:
    """No request left anywhere, and each pool's integrity check passes."""
    pair.run()
    pair.settle()
    assert not pair.router.reqs and not pair.decode.core.reqs and not pair.prefill.core.reqs
    pair.decode.check_integrity()
    pair.prefill.check_integrity()


# -- the incident chain: L1, L2, L3, L4, L5 each stop the placeholder -------------------------------------


@pytest.mark.model
def test_every_layer_off_the_placeholder_is_answered_200(monkeypatch, model):
    """The harm all the following tests prevent: an over-length prompt decoded from stale pages, status 200."""
    result = victim_then_attacker(incident_pair(monkeypatch, model, "all"))
    assert result.status == 200 and len(result.tokens) == 4


@pytest.mark.model
def test_l1_admission_rejects_before_any_grant(monkeypatch, model):
    pair = incident_pair(monkeypatch, model, "preflight")
    epochs = pair.decode.engine.pages.epoch.copy()
    attacker = pair.submit(OVER_LENGTH, max_tokens=4)
    error = pair.results[attacker].error  # decided by the router at once: nothing was sent to a worker
    assert error.status == 400 and error.code == "context_length_exceeded" and error.layer == "admission"
    assert "40 in the messages" in error.message and "32 tokens" in error.message  # the real counts
    assert not pair.inflight and (pair.decode.engine.pages.epoch == epochs).all()  # no page granted


@pytest.mark.model
def test_l1_off_an_over_length_request_is_answered_200(monkeypatch, model):
    """Prompt + max_tokens over the context, on a deployment whose pools hold the prompt: only L1 says no."""
    pair = pair_with(monkeypatch, model, "admission", max_context=64, prefill_pool=64, decode_pool=64)
    rid = pair.submit(SHORT, max_tokens=60)  # 30 + 60 > 64
    pair.run([rid])
    assert pair.results[rid].status == 200  # wrong: it was over the context
    pair = pair_with(monkeypatch, model, "", max_context=64, prefill_pool=64, decode_pool=64)
    rid = pair.submit(SHORT, max_tokens=60)
    assert pair.results[rid].error.code == "context_length_exceeded"


@pytest.mark.model
def test_l2_propagation_carries_prefills_rejection_to_the_client(monkeypatch, model):
    """Only L2 on among the layers that stop the placeholder: prefill's 400 reaches the client."""
    pair = incident_pair(monkeypatch, model, "preflight,admission,tags,coverage,checksum")
    result = victim_then_attacker(pair)
    assert result.status == 400 and result.error.code == "context_length_exceeded" and not result.tokens
    assert_clean(pair)


@pytest.mark.model
def test_l2_off_the_decode_legs_status_wins(monkeypatch, model):
    """L2 off (coverage left on): the client gets a 500 for its own over-length prompt, not the 400."""
    pair = incident_pair(monkeypatch, model, "preflight,admission,propagation,tags,checksum")
    result = victim_then_attacker(pair)
    assert result.status == 500 and result.error.layer == "coverage"


@pytest.mark.model
@pytest.mark.parametrize("layer", ["coverage", "tags", "checksum"])
def test_each_landing_check_alone_stops_the_placeholder(monkeypatch, model, layer):
    """L4, L3 and L5 each alone (the other two, L1 and L2 off): a 500 naming the layer, no token; the failed
    landing's pages are held until prefill acknowledges decode's Abort, then come back, and the next request is
    served from them."""
    others = {"coverage", "tags", "checksum"} - {layer}
    pair = incident_pair(monkeypatch, model, ",".join(["preflight", "admission", "propagation", *others]))
    result = victim_then_attacker(pair)
    assert result.status == 500 and result.error.layer == layer and not result.tokens
    assert_clean(pair)
    pages = pair.decode.engine.pages
    assert pages.num_quarantined == 0 and pages.num_free == pages.num_pages and not pair.decode.core.held
    again = pair.submit(VICTIM, max_tokens=8)
    pair.run([again])
    assert pair.results[again].status == 200


# -- late writes: L6 prevents them, L3 catches them ------------------------------------------------------


def alone(pair: Pair, prompt: list[int]) -> list[int]:
    """``prompt``'s greedy tokens with nothing else running: the reference a harmed request is compared with."""
    rid = pair.submit(prompt, max_tokens=8)
    pair.run([rid])
    return pair.results[rid].tokens


def late_write_scenario(pair: Pair) -> tuple[object, list[int]]:
    """B's KV transfer is in flight when its client leaves; then C arrives, needing B's pages (the decode pool
    holds one request). Returns C's result and C's reference tokens (C alone, before anything else)."""
    expected = alone(pair, VICTIM)
    pair.hold_writes()
    b = pair.submit(SHORT, max_tokens=8)
    for _ in range(3):
        pair.step()  # B computed; its writes are in flight
    assert pair.held
    pair.stop_holding()
    pair.client_gone(b)
    pair.step()
    c = pair.submit(VICTIM, max_tokens=8)
    pair.step_until(lambda: pair.results[c].tokens)  # C decodes now only if B's pages were released early
    pair.release_writes()  # B's late writes land now, wherever B's pages went
    pair.run([c])
    return pair.results[c], expected


def late_write_pair(monkeypatch, model: str, unsafe: str) -> Pair:
    """A decode pool of 3 pages, under the context (L0 off), so C can only be granted the pages B held."""
    unsafe = ",".join(filter(None, (unsafe, "preflight")))
    return pair_with(monkeypatch, model, unsafe, max_context=64, prefill_pool=64, decode_pool=2 * PAGE + PAGE)


@pytest.mark.model
def test_l6_deferred_release_keeps_pages_until_the_writer_is_done(monkeypatch, model):
    """L6 on (L7 off, so the abort reaches decode mid-transfer): C waits for B's pages and decodes correctly."""
    pair = late_write_pair(monkeypatch, model, "deferred_abort")
    result, expected = late_write_scenario(pair)
    assert result.status == 200 and result.tokens == expected
    assert_clean(pair)


@pytest.mark.model
def test_l6_off_a_late_write_lands_in_the_next_owners_pages_and_l3_catches_it(monkeypatch, model):
    pair = late_write_pair(monkeypatch, model, "deferred_abort,deferred_release")
    result, _ = late_write_scenario(pair)
    assert result.status == 500 and result.error.layer == "tags"  # an innocent request failed: the harm of L6 off


@pytest.mark.model
def test_l6_and_l3_off_the_late_write_corrupts_the_next_owners_output(monkeypatch, model):
    pair = late_write_pair(monkeypatch, model, "deferred_abort,deferred_release,tags")
    result, expected = late_write_scenario(pair)
    assert result.status == 200 and result.tokens != expected, result.error  # computed from B KV: what L3 stops


@pytest.mark.model
def test_l7_deferred_abort_lets_the_transfer_finish_before_cancelling(monkeypatch, model):
    """L7 on (L6 off): the disconnect waits for the handoff, so B's writes land before its pages are freed."""
    pair = late_write_pair(monkeypatch, model, "deferred_release")
    result, expected = late_write_scenario(pair)
    assert result.status == 200 and result.tokens == expected
    assert_clean(pair)


# -- flipped bytes on the data plane: L5 ----------------------------------------------------------------


def flipped_byte_scenario(pair: Pair):
    expected = alone(pair, VICTIM)
    pair.hold_writes()
    rid = pair.submit(VICTIM, max_tokens=8)
    for _ in range(3):
        pair.step()
    pair.release_writes()  # landed; decode has not yet seen Done
    grants = pair.decode.core.reqs[rid].grants
    region = pair.decode.engine.pool.region
    page = region.pages[grants[0].page]
    page[: len(page) // 2] = np.bitwise_xor(page[: len(page) // 2], 0x40)  # corrupted in flight
    pair.run([rid])
    return pair.results[rid], expected


@pytest.mark.model
def test_l5_checksum_catches_bytes_flipped_in_flight(monkeypatch, model):
    pair = pair_with(monkeypatch, model, "", max_context=64, prefill_pool=64, decode_pool=64)
    result, _ = flipped_byte_scenario(pair)
    assert result.status == 500 and result.error.layer == "checksum" and not result.tokens
    assert_clean(pair)


@pytest.mark.model
def test_l5_off_flipped_bytes_change_the_output(monkeypatch, model):
    pair = pair_with(monkeypatch, model, "checksum", max_context=64, prefill_pool=64, decode_pool=64)
    result, expected = flipped_byte_scenario(pair)
    assert result.status == 200 and result.tokens != expected


# -- L0 --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_l0_preflight_refuses_an_undersized_pool(model):
    cmd = [sys.executable, "-m", "kvfence.cli", "serve", "--model", model, "--mode", "colocated",
           "--max-context", "4096", "--kv-pool-tokens", "1024"]
    env = {k: v for k, v in os.environ.items() if k != "KVFENCE_UNSAFE"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "holds 1024 tokens" in done.stderr and "--kv-pool-tokens" in done.stderr


@pytest.mark.slow
def test_l0_off_the_undersized_node_starts_and_cannot_serve_its_context(model):
    with Server("--model", model, "--mode", "colocated", "--max-context", "4096", "--kv-pool-tokens", "1024",
                env={"KVFENCE_UNSAFE": "preflight"}) as server:
        assert "WARNING (preflight off)" in server.output()
        client = server.client()
        served = client.models.list().data[0]
        assert served.max_model_len == 4096  # what it advertises...
        with pytest.raises(openai.BadRequestError):  # ...it cannot serve
            client.completions.create(model=served.id, prompt=[5] * 2000, max_tokens=8)


# -- L3 before every decode step ------------------------------------------------------------------------------


def decoding_pair_of_requests(model: str, safety: Safety):
    """A decode-side engine (tag records checked) with two requests decoding, A and B."""
    loaded = load_model(model, dtype=torch.bfloat16)
    config = EngineConfig(max_context=64, kv_pool_tokens=8 * PAGE, page_size=PAGE, max_batch=4, chunk_size=64)
    engine = Engine(loaded.model, loaded.tokenizer, config, torch.bfloat16, safety=safety, remote_writes=True)
    for rid, prompt in ((1, VICTIM), (2, SHORT)):
        engine.add(Request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), "t", rid=rid))
    while any(not s.req.output_ids for s in engine.seqs.values()):
        engine.step()
    return engine


def run_out(engine) -> dict[int, tuple[list[int], RequestOutput]]:
    """Step until every request ended: per request, all its tokens from here on and its last output."""
    tokens: dict[int, list[int]] = {rid: [] for rid in engine.seqs}
    last = {}
    while engine.seqs:
        for out in engine.step():
            tokens[out.rid] += out.token_ids
            last[out.rid] = out
    return {rid: (tokens[rid], last[rid]) for rid in last}


def overwrite_with_b(engine) -> None:
    """What a late write from an earlier grant does: B's KV and B's tag record land in A's first page."""
    region, a, b = engine.region, engine.seqs[1].grants[0], engine.seqs[2].grants[0]
    region.pages[a.page] = region.pages[b.page]
    region.write_tag(a.page, 2, b.epoch, a.page, PAGE, 0)


@pytest.mark.model
@pytest.mark.parametrize("path", ["c", "numpy"])
def test_l3_a_page_overwritten_under_a_decoding_request_fails_it_alone(model, path, monkeypatch):
    if path == "numpy":
        monkeypatch.setattr(pages, "_tag_check", lambda: None)
    clean = run_out(decoding_pair_of_requests(model, Safety()))
    engine = decoding_pair_of_requests(model, Safety())
    assert engine.pages.all_held([s.tags for s in engine.seqs.values()], engine.region.tags) == (path == "c")
    overwrite_with_b(engine)
    outs = run_out(engine)
    assert outs[1][1].finish_reason == FinishReason.ERROR and outs[1][1].error.layer == "tags"
    assert outs[2][1].finish_reason == FinishReason.LENGTH and outs[2][0] == clean[2][0]
    engine.pages.check_integrity()


@pytest.mark.model
def test_l3_off_a_page_overwritten_under_a_decoding_request_changes_its_output(model):
    clean = run_out(decoding_pair_of_requests(model, Safety(tags=False)))
    engine = decoding_pair_of_requests(model, Safety(tags=False))
    overwrite_with_b(engine)
    outs = run_out(engine)
    assert outs[1][1].finish_reason == FinishReason.LENGTH
    assert outs[1][0] != clean[1][0]  # decoded from B's KV: what L3 stops


# -- n > 1: copy-on-fork of the prompt's partial page --------------------------------------------------------


def choices_of(model: str, safety: Safety, n: int, seed: int) -> list[list[int]]:
    """Each choice's tokens for SHORT (30 tokens: its last page is partial) on a decode-side engine; every page is
    free again at the end."""
    loaded = load_model(model, dtype=torch.bfloat16)
    config = EngineConfig(max_context=64, kv_pool_tokens=16 * PAGE, page_size=PAGE, max_batch=4, chunk_size=64)
    engine = Engine(loaded.model, loaded.tokenizer, config, torch.bfloat16, safety=safety, remote_writes=True)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True, n=n)
    engine.add(Request(SHORT, params, "t", rid=1))
    tokens: list[list[int]] = [[] for _ in range(n)]
    while engine.seqs:
        for out in engine.step():
            tokens[out.index] += out.token_ids
    engine.check_integrity()
    assert engine.pages.num_free == engine.pages.num_pages
    return tokens


@pytest.mark.model
def test_forked_choices_write_into_their_own_copy_of_the_partial_page(model):
    alone = [choices_of(model, Safety(), 1, 5 + i)[0] for i in range(3)]
    assert choices_of(model, Safety(), 3, 5) == alone


@pytest.mark.model
def test_shared_write_off_choices_write_into_one_partial_page_and_corrupt_each_other(model):
    """With the partial page shared, every choice writes its first token's K/V into the same slot: all but the last
    writer then read another choice's K/V."""
    alone = [choices_of(model, Safety(), 1, 5 + i)[0] for i in range(3)]
    corrupted = choices_of(model, Safety(shared_write=False), 3, 5)
    assert [t[0] for t in corrupted] == [t[0] for t in alone]  # sampled from the prompt's logits: still right
    assert [c == a for c, a in zip(corrupted, alone, strict=True)] == [False, False, True]  # the last writer wins
