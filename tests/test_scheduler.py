"""Continuous batching: chunk boundaries, admission, growth and preemption, on a real page table."""

from kvfence.config import EngineConfig
from kvfence.core import Request, SamplingParams
from kvfence.engine.scheduler import Scheduler, Sequence
from kvfence.kvcache.pages import PageTable


def make(pool_tokens=64, page=4, chunk=8, step=16, batch=8):
    cfg = EngineConfig(max_context=64, kv_pool_tokens=pool_tokens, page_size=page, chunk_size=chunk,
                       step_tokens=step, max_batch=batch)
    return Scheduler(cfg, PageTable(cfg.num_pages))


def seq(prompt_len: int, rid: int) -> Sequence:
    return Sequence(Request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8), rid=rid))


def run(sched: Scheduler) -> list[tuple[int, int, int]]:
    """One step: schedule, then pretend the model computed it and sampled token 7 where due."""
    work = sched.schedule()
    for w in work:
        w.seq.num_computed = w.end
        if w.samples:
            w.seq.req.output_ids.append(7)
    return [(w.seq.rid, w.start, w.end) for w in work]


def test_prefill_chunks_have_fixed_boundaries_and_decodes_go_first():
    s = make(step=16, chunk=8)
    s.add(seq(20, rid=1))
    s.add(seq(5, rid=2))
    assert run(s) == [(1, 0, 8), (2, 0, 5)]  # budget 16: a's first chunk, then all of b
    assert run(s) == [(2, 5, 6), (1, 8, 16)]  # b decodes; a's next chunk starts on the boundary
    assert run(s) == [(2, 6, 7), (1, 16, 20)]
    assert run(s) == [(1, 20, 21), (2, 7, 8)]  # both decode, oldest first


def test_budget_defers_chunks_but_first_chunk_always_runs():
    s = make(step=8, chunk=8)
    s.add(seq(12, rid=1))
    s.add(seq(3, rid=2))
    assert run(s) == [(1, 0, 8)]  # budget spent: b is admitted, its chunk waits
    assert run(s) == [(1, 8, 12), (2, 0, 3)]


def test_admission_grants_whole_prompt_pages_in_order():
    s = make(page=4)
    a, b = seq(9, rid=1), seq(4, rid=2)
    s.add(a)
    s.add(b)
    s.schedule()
    assert [g.page for g in a.grants] == [0, 1, 2]
    assert [g.page for g in b.grants] == [3]
    assert all(g.epoch == 1 for g in a.grants + b.grants)


def test_decode_grows_one_page_at_a_time():
    s = make(page=4, chunk=8)
    a = seq(4, rid=1)
    s.add(a)
    assert run(s) == [(1, 0, 4)]  # prompt fills page 0 exactly; first token sampled
    assert len(a.grants) == 1
    assert run(s) == [(1, 4, 5)]  # decoding position 4 needs page 1
    assert [g.page for g in a.grants] == [0, 1]


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


def test_max_batch_limits_running():
    s = make(batch=2)
    for rid in (1, 2, 3):
        s.add(seq(2, rid=rid))
    run(s)
    assert [x.rid for x in s.running] == [1, 2] and [x.rid for x in s.waiting] == [3]
