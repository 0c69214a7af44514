"""``n`` > 1 choices through the official openai client on real servers (tiny random-weight Llama), colocated and
disaggregated, and through ``LLM``: one prefill per request (the prompt-tokens-computed metric), choice i is what
``n=1`` with ``seed + i`` gives, greedy choices agree, streamed chunks name their choice, and every page is free
after a request however it ended. The page-level rules (refcounts, the write guard, L3 for shared pages) are
unit-tested in test_pages.py and test_scheduler.py, and proved needed in test_safety.py (``shared_write``)."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvfence import LLM, SamplingParams
from kvfence.config import EngineConfig
from kvfence.core import FinishReason, Request
from kvfence.core import SamplingParams as EngineParams
from kvfence.engine.engine import Engine
from kvfence.model.loader import load_model
from kvfence.safety import Safety
from tests.server import Server
from tests.test_structured import AS_PERSON, assert_person
from tests.tiny_models import tiny_model_dir

PROMPT = "Tell me a story about a cat and a boat, please."  # its last KV page is partial
ASK = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def server(request) -> Server:
    return request.getfixturevalue(f"tiny_{request.param}")


def complete(server: Server, **kw) -> Completion:
    reply = server.client().completions.create(model="llama", prompt=PROMPT, **({"max_tokens": 12} | kw))
    Completion.model_validate(reply.model_dump())
    return reply


def texts(reply: Completion | ChatCompletion) -> list[str]:
    assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
    return [c.text if isinstance(reply, Completion) else c.message.content for c in reply.choices]


@pytest.mark.slow
def test_choice_i_is_what_one_choice_with_seed_plus_i_gives(server):
    reply = complete(server, n=3, seed=11, extra_body={"ignore_eos": True})
    alone = [complete(server, seed=11 + i, extra_body={"ignore_eos": True}) for i in range(3)]
    assert texts(reply) == [texts(a)[0] for a in alone]
    assert len(set(texts(reply))) == 3  # temperature 1: distinct samples
    assert texts(complete(server, n=3, seed=11, extra_body={"ignore_eos": True})) == texts(reply)  # reproducible
    assert reply.usage.completion_tokens == 3 * 12 and reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert {c.finish_reason for c in reply.choices} == {"length"}


@pytest.mark.slow
def test_greedy_choices_agree_colocated_and_disaggregated(tiny_colocated, tiny_disaggregated):
    """(Seeded sampling does not agree across the modes, with one choice as with several: decode seeds its own
    generator afresh after prefill drew the first token with one.)"""
    kw = {"n": 3, "temperature": 0, "extra_body": {"ignore_eos": True}}
    assert texts(complete(tiny_colocated, **kw)) == texts(complete(tiny_disaggregated, **kw))


@pytest.mark.slow
def test_greedy_choices_are_identical_and_the_single_greedy_answer(server):
    one = server.client().chat.completions.create(model="llama", messages=ASK, max_tokens=16, temperature=0)
    two = server.client().chat.completions.create(model="llama", messages=ASK, max_tokens=16, temperature=0, n=2)
    ChatCompletion.model_validate(two.model_dump())
    assert texts(two) == texts(one) * 2
    assert [c.finish_reason for c in two.choices] == [one.choices[0].finish_reason] * 2
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert two.usage.prompt_tokens == one.usage.prompt_tokens


def metric(server: Server, name: str) -> int:
    """``name`` summed over its labels, from ``/metrics`` (open without a tenants file)."""
    text = httpx.get(server.url + "/metrics").text
    return sum(int(float(v)) for v in re.findall(rf"^{name}\{{.*\}} (\S+)$", text, re.M))


def settled(server: Server, name: str) -> int:
    """``name`` once two readings a heartbeat and more apart agree (disaggregated: heartbeats carry it)."""
    last, deadline = metric(server, name), time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(1.2)  # what is checked is stability: two readings more than a heartbeat (1 s) apart agree
        if (now := metric(server, name)) == last:
            return now
        last = now
    raise AssertionError(f"{name} did not settle")


@pytest.mark.slow
def test_the_prompt_is_computed_once_for_all_choices(server):
    before = settled(server, "kvfence_prompt_tokens_computed_total")
    reply = complete(server, n=5, seed=1)
    assert settled(server, "kvfence_prompt_tokens_computed_total") == before + reply.usage.prompt_tokens


@pytest.mark.slow
def test_streamed_choices_name_their_index_and_add_up_to_the_whole_answer(server):
    kw = {"model": "llama", "messages": ASK, "max_tokens": 16, "temperature": 0, "n": 3}
    whole = server.client().chat.completions.create(**kw)
    chunks = list(server.client().chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    content, finishes, roles = ["", "", ""], [[], [], []], [0, 0, 0]
    for choice in (c for chunk in chunks for c in chunk.choices):
        content[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert content == texts(whole) and roles == [1, 1, 1]
    assert finishes == [[c.finish_reason] for c in whole.choices]
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


@pytest.mark.slow
def test_streamed_legacy_completions_name_their_index(server):
    whole = complete(server, n=2, seed=5)
    text = ["", ""]
    for chunk in server.client().completions.create(model="llama", prompt=PROMPT, max_tokens=12, n=2, seed=5,
                                                    stream=True):
        for choice in chunk.choices:
            text[choice.index] += choice.text
    assert text == texts(whole)


@pytest.mark.slow
def test_every_choice_matches_the_schema(server):
    reply = server.client().chat.completions.create(model="llama", messages=ASK, max_tokens=120, n=3, seed=4,
                                                    response_format=AS_PERSON)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert_person(json.loads(choice.message.content))


@pytest.mark.slow
@pytest.mark.parametrize("n", [0, 17, -1])
def test_n_outside_1_to_16_is_a_400_naming_n(server, n):
    with pytest.raises(openai.BadRequestError) as err:
        complete(server, n=n)
    assert err.value.body["param"] == "n" and err.value.body["type"] == "invalid_request_error"
    assert "'n' must be between 1 and 16" in err.value.body["message"]


@pytest.mark.slow
def test_each_choice_is_checked_against_the_context_alone(tiny_colocated):
    prompt_tokens = complete(tiny_colocated).usage.prompt_tokens
    fits = 1024 - prompt_tokens  # --max-context 1024
    reply = complete(tiny_colocated, n=2, max_tokens=fits, temperature=0, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in reply.choices] == ["length"] * 2
    with pytest.raises(openai.BadRequestError) as err:
        complete(tiny_colocated, n=2, max_tokens=fits + 1)
    assert err.value.code == "context_length_exceeded"


def assert_every_page_comes_back(server: Server) -> None:
    """No page of any pool is in use or quarantined, within a few heartbeats."""
    assert metric(server, "kvfence_kv_pages_total") > 0
    deadline = time.monotonic() + 10
    while metric(server, "kvfence_kv_pages_in_use") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "kvfence_kv_pages_in_use") == metric(server, "kvfence_kv_pages_quarantined") == 0


@pytest.mark.slow
def test_every_page_is_free_after_choices_end_or_their_client_leaves(server):
    long = {"model": "llama", "prompt": PROMPT, "max_tokens": 900, "n": 4, "extra_body": {"ignore_eos": True}}
    complete(server, n=4)
    assert_every_page_comes_back(server)
    stream = server.client().completions.create(stream=True, **long)
    for _, _ in zip(range(5), stream, strict=False):
        pass
    stream.close()  # mid-stream
    assert_every_page_comes_back(server)
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=0.5).completions.create(**long)  # the client leaves before the answer
    assert_every_page_comes_back(server)


# -- in process: the LLM API and the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(tiny_model_dir("llama")), max_model_len=256, kv_pool_tokens=1024)


@pytest.mark.model
def test_llm_choices_are_the_seed_streams_and_free_their_pages(llm):
    [out] = llm.generate(PROMPT, SamplingParams(n=3, seed=9, max_tokens=10, ignore_eos=True))
    alone = [llm.generate(PROMPT, SamplingParams(seed=9 + i, max_tokens=10, ignore_eos=True))[0].outputs[0]
             for i in range(3)]
    assert [(o.index, o.token_ids, o.finish_reason) for o in out.outputs] == \
        [(i, a.token_ids, "length") for i, a in enumerate(alone)]
    assert llm.engine.pages.num_free == llm.engine.pages.num_pages
    llm.engine.check_integrity()
    with pytest.raises(ValueError):
        SamplingParams(n=17).for_engine()


@pytest.mark.model
def test_a_choice_that_stops_early_ends_alone(llm):
    [out] = llm.generate(PROMPT, SamplingParams(n=4, seed=2, max_tokens=6, stop_token_ids=[]))
    [greedy] = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=1))
    assert [o.finish_reason for o in greedy.outputs] == ["length"] * 3 and len({o.text for o in greedy.outputs}) == 1
    assert all(o.finish_reason in ("stop", "length") for o in out.outputs)


def forked_engine() -> Engine:
    """A decode-side engine (tag records checked) with one request of 2 choices, forked and decoding."""
    loaded = load_model(str(tiny_model_dir("llama")), dtype=torch.bfloat16)
    config = EngineConfig(max_context=64, kv_pool_tokens=16 * 16, page_size=16, max_batch=4, chunk_size=64)
    engine = Engine(loaded.model, loaded.tokenizer, config, torch.bfloat16, safety=Safety(), remote_writes=True)
    engine.add(Request(list(range(5, 45)), EngineParams(max_tokens=8, seed=1, ignore_eos=True, n=2), "t", rid=1))
    while len(engine.seqs) < 2:
        engine.step()
    return engine


@pytest.mark.model
def test_l3_fails_a_choice_reading_a_shared_page_it_no_longer_holds():
    engine = forked_engine()
    branch = next(s for s in engine.seqs.values() if s.index == 1)
    assert branch.shared == 2 and [engine.pages.refcount(p) for p in branch.page_ids] == [2, 2, 1]
    engine.pages.free(branch.rid, branch.grants[:1])  # as if released, while its tags still name the page
    outs = engine.step()
    assert [(o.rid, o.finish_reason, o.error.layer) for o in outs] == [(1, FinishReason.ERROR, "tags")]
    assert not engine.seqs and engine.pages.num_quarantined == 1  # the choice's own copy: tags mismatched
    engine.check_integrity()


@pytest.mark.model
def test_abort_frees_every_choices_pages():
    engine = forked_engine()
    assert engine.abort(1).finish_reason is FinishReason.ABORT
    assert not engine.seqs and engine.pages.num_free == engine.pages.num_pages
    engine.check_integrity()


@pytest.mark.slow
def test_every_choice_makes_its_required_call_streamed_or_not(server):
    from tests.test_tools import TOOLS

    kw = {"model": "llama", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 150, "n": 2,
          "seed": 8, "parallel_tool_calls": False}  # one call each: a random model may otherwise chain calls past 150
    whole = server.client().chat.completions.create(**kw)
    ChatCompletion.model_validate(whole.model_dump())
    assert all(c.message.tool_calls for c in whole.choices)  # a random model's arguments may run to max_tokens
    streamed: list[list[tuple[str, str]]] = [[], []]
    finishes: list[str | None] = [None, None]
    for chunk in server.client().chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += [(t.function.name, t.function.arguments) for t in choice.delta.tool_calls or ()]
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert streamed == [[(t.function.name, t.function.arguments) for t in c.message.tool_calls] for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
