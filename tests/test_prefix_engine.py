"""Prefix caching in the colocated engine (tiny random-weight Llama; one test on the real SmolLM2): a hit gives
the tokens a miss gives, the hit is capped to whole pages leaving two tokens to compute, tenants and salts never
share pages (and do with ``prefix_scope`` off), prompt logprobs bypass the cache, and eviction under pool
pressure never frees a page a running request reads. The integrity check runs after every step."""

from __future__ import annotations

import pytest
import torch

from kvfence.config import EngineConfig
from kvfence.core import Request, SamplingParams
from kvfence.engine.engine import Engine
from kvfence.model.loader import LoadedModel, load_model
from kvfence.safety import Safety
from tests.tiny_models import smollm2, tiny_model_dir

pytestmark = pytest.mark.model


PS = 16
SYSTEM = [100 + (7 * i) % 3000 for i in range(70)]  # a shared prefix of 4 full pages and 6 tokens


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), dtype=torch.bfloat16)


def engine(loaded: LoadedModel, caching: bool = True, pages: int = 64, chunk: int = 32,
           safety: Safety | None = None) -> Engine:
    """Chunks of 32 tokens, so prompts of ~100 tokens cross chunk boundaries and hits end inside a chunk."""
    config = EngineConfig(max_context=min(1024, pages * PS), kv_pool_tokens=pages * PS, page_size=PS, chunk_size=chunk,
                          step_tokens=chunk, prefix_caching=caching)
    return Engine(loaded.model, loaded.tokenizer, config, torch.bfloat16, safety=safety or Safety())


def greedy(n: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run(e: Engine, reqs: list[Request]) -> dict[int, tuple[list[int], int]]:
    """Run ``reqs`` together to their ends: rid -> (tokens, cached_tokens of the first output)."""
    out: dict[int, tuple[list[int], int]] = {}
    for req in reqs:
        e.add(req)
    while e.has_work:
        for o in e.step():
            tokens, cached = out.get(o.rid, ([], o.cached_tokens))
            out[o.rid] = (tokens + o.token_ids, cached)
        e.check_integrity()
    return out


def one(e: Engine, prompt: list[int], tenant: str = "alice", salt: str | None = None,
        params: SamplingParams | None = None) -> tuple[list[int], int]:
    req = Request(prompt, params or greedy(), tenant, cache_salt=salt)
    return run(e, [req])[req.rid]


def test_a_hit_gives_the_tokens_a_miss_gives_and_reports_the_tokens_read(tiny):
    prompts = [SYSTEM + [5000 + i] * (3 + 11 * i) for i in range(4)]  # 73 .. 106 tokens
    reference = [one(engine(tiny, caching=False), p)[0] for p in prompts]
    e = engine(tiny)
    first = one(e, prompts[0])
    assert first == (reference[0], 0)
    for p, ref in zip(prompts[1:], reference[1:], strict=True):
        assert one(e, p) == (ref, 4 * PS)  # the system prompt's 4 full pages
    assert one(e, prompts[3]) == (reference[3], (len(prompts[3]) - 2) // PS * PS)  # all but its last page
    assert e.prompt_tokens_computed < sum(map(len, prompts)) + len(prompts[3])


@pytest.mark.parametrize("length", [32, 33, 34, 48, 65])
def test_the_hit_is_whole_pages_that_leave_two_tokens_to_compute(tiny, length):
    prompt = SYSTEM[:length] if length <= len(SYSTEM) else SYSTEM + [9] * (length - len(SYSTEM))
    e = engine(tiny)
    miss = one(e, prompt)
    hit = one(e, prompt)
    assert hit == (miss[0], (length - 2) // PS * PS)


def test_requests_sharing_a_prefix_in_one_batch_agree_with_a_miss(tiny):
    prompts = [SYSTEM + [6000 + i] * 20 for i in range(3)]
    reference = [one(engine(tiny, caching=False), p)[0] for p in prompts]
    e = engine(tiny)
    one(e, SYSTEM + [1])
    reqs = [Request(p, greedy(), "alice") for p in prompts]
    out = run(e, reqs)
    assert [out[r.rid] for r in reqs] == [(ref, 4 * PS) for ref in reference]


def test_another_tenant_or_salt_recomputes_and_with_prefix_scope_off_it_reads_alices_pages(tiny):
    e = engine(tiny)
    alice = one(e, SYSTEM + [1, 2])
    assert one(e, SYSTEM + [1, 2], tenant="bob") == (alice[0], 0)
    assert one(e, SYSTEM + [1, 2], salt="s") == (alice[0], 0)
    assert one(e, SYSTEM + [1, 2], salt="s")[1] == 4 * PS  # the same salt shares
    assert one(e, SYSTEM + [1, 2])[1] == 4 * PS
    owners = {e.pages.owner_of(page) for page in e.cache.held}
    assert len(owners) == 3  # alice, alice with salt s, bob: three caches, none reading another

    unscoped = engine(tiny, safety=Safety(prefix_scope=False))
    one(unscoped, SYSTEM + [1, 2])
    assert one(unscoped, SYSTEM + [1, 2], tenant="bob", salt="x") == (alice[0], 4 * PS)  # the harm


def test_prompt_logprobs_bypass_the_cache(tiny):
    e = engine(tiny)
    one(e, SYSTEM + [1, 2])
    params = greedy(prompt_logprobs=1)
    assert one(e, SYSTEM + [1, 2], params=params)[1] == 0


def test_choices_read_cached_pages_and_agree_with_a_miss(tiny):
    prompt = SYSTEM + [3] * 9
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)

    def choices(e: Engine) -> tuple[list[list[int]], int]:
        e.add(Request(prompt, params, "alice"))
        tokens, cached = [[] for _ in range(3)], None
        while e.has_work:
            for o in e.step():
                tokens[o.index] += o.token_ids
                cached = o.cached_tokens if cached is None else cached
            e.check_integrity()
        return tokens, cached

    reference, _ = choices(engine(tiny, caching=False))
    e = engine(tiny)
    assert choices(e) == (reference, 0)
    assert choices(e) == (reference, 4 * PS)


def test_eviction_under_pressure_never_frees_a_page_a_running_request_reads(tiny):
    """A 14-page pool, ten prompts of 5-7 pages sharing 4, 24 tokens each, all at once: cached pages are evicted
    (least recently used) to admit and grow requests, requests are preempted and recompute, the integrity check
    (every held page belongs to a live request or the cache, refcounts match readers) holds after every step,
    and every answer is the one a cacheless engine gives."""
    prompts = [SYSTEM + [7000 + i] * (10 + 9 * (i % 4)) for i in range(10)]
    alone = [Request(p, greedy(24)) for p in prompts]
    reference = [out[r.rid][0] for out in [run(engine(tiny, caching=False), alone)] for r in alone]  # batch-invariant
    e = engine(tiny, pages=14)
    reqs = [Request(p, greedy(24), "alice") for p in prompts]
    out = run(e, reqs)
    assert [out[r.rid][0] for r in reqs] == reference
    assert e.cache.evictions > 0 and e.scheduler.num_preempted > 0 and any(out[r.rid][1] for r in reqs)
    assert e.free_pages == e.pages.num_pages  # idle: every cached page may be evicted


def test_smollm2_answers_the_same_from_the_cache():
    """The real model (Q4_1 blocks, int8 rows where the host has them, C attention), a prompt past one 512-token
    chunk; the hit ends inside the first chunk."""
    loaded = smollm2()
    chat = loaded.tokenizer.encode("The quarterly report covers logistics, staffing and budgets. " * 60)[:560]
    prompts = [chat + loaded.tokenizer.encode(q) for q in (" Summarize it.", " What is the capital of France?")]
    reference = [one(engine(loaded, caching=False, pages=96, chunk=512), p)[0] for p in prompts]
    e = engine(loaded, pages=96, chunk=512)
    assert one(e, prompts[0]) == (reference[0], 0)
    assert one(e, prompts[1]) == (reference[1], 560 // PS * PS)
    assert one(e, prompts[0]) == (reference[0], (len(prompts[0]) - 2) // PS * PS)
