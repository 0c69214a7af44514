"""Continuous batching: chunk boundaries, admission, growth and preemption, on a real page table; fair shares
across tenants, and preemption by share on a real engine with the tiny model."""

import pytest
import torch

from kvfence.config import EngineConfig
from kvfence.core import Request, SamplingParams
from kvfence.engine.engine import Engine
from kvfence.engine.scheduler import Scheduler, Sequence
from kvfence.kvcache.pages import PageTable
from kvfence.model.loader import load_model
from tests.tiny_models import tiny_model_dir


def make(pool_tokens=64, page=4, chunk=8, step=16, batch=8, fair=True):
    cfg = EngineConfig(max_context=64, kv_pool_tokens=pool_tokens, page_size=page, chunk_size=chunk,
                       step_tokens=step, max_batch=batch, fair=fair)
    return Scheduler(cfg, PageTable(cfg.num_pages))


def seq(prompt_len: int, rid: int, tenant: str = "default", weight: float = 1.0) -> Sequence:
    return Sequence(Request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8), tenant, rid=rid,
                            weight=weight))


def run(sched: Scheduler) -> list[tuple[int, int, int]]:
    """One step: schedule, then pretend the model computed it and sampled token 7 where due."""
    work = sched.schedule()
    for w in work:
        w.seq.num_computed = w.end
        if w.samples:
            w.seq.req.output_ids.append(7)
    return [(w.seq.rid, w.start, w.end) for w in work]


@pytest.mark.fast
def test_prefill_chunks_have_fixed_boundaries_and_decodes_go_first():
    s = make(step=16, chunk=8)
    s.add(seq(20, rid=1))
    s.add(seq(5, rid=2))
    assert run(s) == [(1, 0, 8), (2, 0, 5)]  # budget 16: a's first chunk, then all of b
    assert run(s) == [(2, 5, 6), (1, 8, 16)]  # b decodes; a's next chunk starts on the boundary
    assert run(s) == [(2, 6, 7), (1, 16, 20)]
    assert run(s) == [(1, 20, 21), (2, 7, 8)]  # both decode, oldest first


@pytest.mark.fast
def test_budget_defers_chunks_but_first_chunk_always_runs():
    s = make(step=8, chunk=8)
    s.add(seq(12, rid=1))
    s.add(seq(3, rid=2))
    assert run(s) == [(1, 0, 8)]  # budget spent: b is admitted, its chunk waits
    assert run(s) == [(1, 8, 12), (2, 0, 3)]


@pytest.mark.fast
def test_admission_grants_whole_prompt_pages_in_order():
    s = make(page=4)
    a, b = seq(9, rid=1), seq(4, rid=2)
    s.add(a)
    s.add(b)
    s.schedule()
    assert [g.page for g in a.grants] == [0, 1, 2]
    assert [g.page for g in b.grants] == [3]
    assert all(g.epoch == 1 for g in a.grants + b.grants)


@pytest.mark.fast
def test_decode_grows_one_page_at_a_time():
    s = make(page=4, chunk=8)
    a = seq(4, rid=1)
    s.add(a)
    assert run(s) == [(1, 0, 4)]  # prompt fills page 0 exactly; first token sampled
    assert len(a.grants) == 1
    assert run(s) == [(1, 4, 5)]  # decoding position 4 needs page 1
    assert [g.page for g in a.grants] == [0, 1]


@pytest.mark.fast
def test_pool_exhaustion_preempts_newest_and_it_resumes():
    s = make(pool_tokens=16, page=4, chunk=8, step=16)  # 4 pages
    a, b = seq(8, rid=1), seq(7, rid=2)
    s.add(a)
    s.add(b)
    run(s)  # a: pages 0,1 ; b: waits (needs 2 pages + 1 growth page for a)
    assert [x.rid for x in s.running] == [1]
    run(s)  # a decodes at position 8 -> page 2; b admitted only if 2 + 1 pages free: no (1 free)
    assert s.pages.num_free == 1
    for _ in range(3):
        run(s)
    assert s.num_preempted == 0
    s.pages.check_integrity()


@pytest.mark.fast
def test_preempted_request_replays_its_tokens_and_frees_pages():
    s = make(pool_tokens=16, page=4, chunk=8, step=16)  # 4 pages
    a, b = seq(4, rid=1), seq(4, rid=2)
    s.add(a)
    s.add(b)
    assert run(s) == [(1, 0, 4), (2, 0, 4)]  # 2 pages used, 2 free
    assert run(s) == [(1, 4, 5), (2, 4, 5)]  # each grows a page: pool full
    for _ in range(3):
        run(s)
    assert s.pages.num_free == 0
    # position 8 needs a fifth page: the newest request (b) is preempted
    assert run(s) == [(1, 8, 9)]
    assert s.num_preempted == 1 and list(s.waiting) == [b] and b.grants == []
    assert b.num_computed == 0 and len(b.req.output_ids) == 5
    s.remove(a)  # a finishes: b comes back, re-prefills its prompt, then replays its 5 tokens one step each
    assert run(s) == [(2, 0, 4)]
    assert len(b.req.output_ids) == 5  # the prompt's logits were not sampled again
    replay = [run(s) for _ in range(5)]
    assert replay == [[(2, p, p + 1)] for p in range(4, 9)]
    assert len(b.req.output_ids) == 6  # only the last replay step sampled a new token
    s.pages.check_integrity()


@pytest.mark.fast
def test_max_batch_limits_running():
    s = make(batch=2)
    for rid in (1, 2, 3):
        s.add(seq(2, rid=rid))
    run(s)
    assert [x.rid for x in s.running] == [1, 2] and [x.rid for x in s.waiting] == [3]


# -- fair shares across tenants (issue 19) ---------------------------------------------------------------------


@pytest.mark.fast
def test_a_newcomers_prompt_goes_before_the_next_chunk_of_a_long_one():
    """bob's 40-token prompt runs a chunk a step; alice's arrives after his first and goes next, not after his
    last (first come, first served would have made her wait four steps)."""
    s = make(pool_tokens=64, page=4, chunk=8, step=8)
    s.add(seq(40, rid=1, tenant="bob"))
    assert run(s) == [(1, 0, 8)]
    s.add(seq(8, rid=2, tenant="alice"))
    assert run(s) == [(2, 0, 8)]
    assert run(s) == [(2, 8, 9), (1, 8, 16)]


@pytest.mark.fast
def test_admission_follows_the_share_and_weights_divide_the_charge():
    """Each step admits one 8-token prompt (which then ends). bob (weight 1) and carol (weight 2) wait with three
    each: carol gets two admissions for each of bob's; on a tie the older request goes first."""
    assert admission_order(fair=True) == [1, 11, 12, 2, 13, 3]


def admission_order(fair: bool) -> list[int]:
    """bob's three 8-token prompts, then carol's (weight 2), one admitted a step, each ending once admitted."""
    s = make(pool_tokens=256, page=4, chunk=8, step=8, batch=16, fair=fair)
    for rid in range(1, 4):
        s.add(seq(8, rid=rid, tenant="bob"))
    for rid in range(11, 14):
        s.add(seq(8, rid=rid, tenant="carol", weight=2.0))
    order = []
    for _ in range(6):
        order += [rid for rid, _, _ in run(s)]
        for x in [x for x in s.running if not x.in_prefill]:
            s.remove(x)
    return order


@pytest.mark.fast
def test_fcfs_admits_in_arrival_order_whatever_the_shares():
    """--scheduling fcfs, the baseline fair sharing is measured against: the same waiting requests as above go
    in the order they came, and the newest request is the one preempted."""
    assert admission_order(fair=False) == [1, 2, 3, 11, 12, 13]
    dry = make(pool_tokens=48, page=4, chunk=8, step=64, batch=8, fair=False)
    bob, alice = [seq(4, rid=r, tenant="bob") for r in (1, 2, 3)], seq(4, rid=4, tenant="alice")
    fill(dry, *bob, alice)
    while not dry.num_preempted:
        run(dry)
    assert alice.preemptions == 1  # the newest, though bob was served three times her tokens


def fill(s: Scheduler, *seqs: Sequence) -> None:
    for x in seqs:
        s.add(x)
    run(s)
    assert all(x in s.running for x in seqs)


@pytest.mark.fast
def test_a_dry_pool_preempts_the_tenant_furthest_over_its_share_not_the_newest_request():
    """alice's request is the newest, so the old rule (preempt the newest) took it; bob has been served three
    times her tokens, so his newest goes instead, and his again while he stays over his share."""
    s = make(pool_tokens=48, page=4, chunk=8, step=64, batch=8)  # 12 pages
    bob = [seq(4, rid=r, tenant="bob") for r in (1, 2, 3)]
    alice = seq(4, rid=4, tenant="alice")
    fill(s, *bob, alice)
    for _ in range(16):
        run(s)
    assert s.num_preempted >= 2 and alice.preemptions == 0 and alice in s.running
    assert sum(b.preemptions for b in bob) == s.num_preempted and bob[2].preemptions >= 1
    s.pages.check_integrity()


@pytest.mark.fast
def test_a_tenant_within_its_weighted_share_is_not_preempted():
    """carol (weight 4) runs three requests against bob's one (weight 1): per unit of weight bob has been served
    more, so bob is preempted although carol holds more pages."""
    s = make(pool_tokens=40, page=4, chunk=8, step=64, batch=8)  # 10 pages
    carol = [seq(4, rid=r, tenant="carol", weight=4.0) for r in (1, 2, 3)]
    bob = seq(4, rid=4, tenant="bob")
    fill(s, bob, *carol)
    while not s.num_preempted:
        run(s)
    assert bob.preemptions == 1 and all(c.preemptions == 0 for c in carol)


# -- on a real engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(tiny_model_dir("llama")), dtype=torch.float32)


def generate(tiny, requests: list[Request], pool_tokens: int) -> dict[int, tuple[list[int], int]]:
    """Run ``requests`` (added together) to the end: per request, its tokens and its last output's preemptions."""
    config = EngineConfig(max_context=96, kv_pool_tokens=pool_tokens, page_size=4, chunk_size=16, max_batch=8)
    engine = Engine(tiny.model, tiny.tokenizer, config, torch.float32)
    for req in requests:
        engine.add(req)
    tokens: dict[int, list[int]] = {req.rid: [] for req in requests}
    preempted = {}
    while engine.has_work:
        for out in engine.step():
            tokens[out.rid] += out.token_ids
            if out.finished:
                preempted[out.rid] = out.preemptions
    engine.check_integrity()
    return {rid: (tokens[rid], preempted[rid]) for rid in tokens}


@pytest.mark.model
def test_preemption_spares_the_tenant_within_its_share_and_keeps_greedy_outputs_exact(tiny):
    """bob floods a small pool with three long generations; alice's one request, added last, is never preempted
    while bob's are; every output equals the same request's greedy output alone in a pool with room to spare."""
    def requests() -> list[Request]:
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        bob = [Request([100 + 7 * r + i for i in range(16)], greedy, "bob", rid=r) for r in (1, 2, 3)]
        return bob + [Request([300 + i for i in range(16)], greedy, "alice", rid=4)]

    crowded = generate(tiny, requests(), pool_tokens=96)  # 24 pages; the four need 14 each at the end
    assert crowded[4][1] == 0
    assert sum(crowded[r][1] for r in (1, 2, 3)) >= 2
    for req in requests():
        alone = generate(tiny, [req], pool_tokens=128)
        assert alone[req.rid] == (crowded[req.rid][0], 0)


@pytest.mark.fast
def test_a_forked_choice_reads_its_lenders_pages_under_the_lenders_tags_and_preemption_drops_only_references():
    s = make(page=4, pool_tokens=32)
    a, b = seq(9, rid=1), seq(9, rid=2)
    s.add(a)
    run(s)  # a's prompt: pages 0..2 (the last one holds 1 token)
    s.pages.share(1, a.grants[:2], 2)
    b.borrow([1, 1], a.grants[:2])
    b.add_grants(s.pages.grant(2, 1))  # its copy of the partial page
    b.num_computed = 9
    b.req.output_ids.append(7)
    s.add_branch(b)
    pages, owner_hi, owner_lo, epochs = b.tags
    assert pages.tolist() == [0, 1, 3]
    assert [(int(h) << 64) | int(lo) for h, lo in zip(owner_hi, owner_lo, strict=True)] == [1, 1, 2]
    assert s.pages.held_by(2, pages, epochs) and not s.pages.held_by(3, pages, epochs)
    assert [s.pages.refcount(p) for p in range(4)] == [2, 2, 1, 1]
    s._preempt(b)  # b recomputes later on pages of its own; a keeps the prompt's pages
    assert [s.pages.refcount(p) for p in range(4)] == [1, 1, 1, 0]
    assert (b.shared, b.lenders, b.grants) == (0, [], [])
    s.pages.check_integrity()
