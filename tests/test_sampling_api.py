"""Sampling parameters through the official openai client on real servers (tiny random-weight Llama): logprobs in
chat, completions and streams, penalties, logit_bias, min_tokens, stop_token_ids; the same tokens and logprobs
colocated and disaggregated (where prefill samples the first token and decode the rest); responses validated
against the openai package's own types; bad values are 400s naming the param."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.server import Server

pytestmark = pytest.mark.slow


CHAT = [{"role": "user", "content": "Tell me a story about a fence."}]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def raw(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "llama"} | body, timeout=60,
                      headers={"Authorization": f"Bearer {server.key}"})


def chat_logprobs(server: Server, top: int = 3, **kw) -> ChatCompletion:
    return server.client().chat.completions.create(model="llama", messages=CHAT, logprobs=True, top_logprobs=top,
                                                   **(GREEDY | kw))


def test_chat_logprobs_describe_the_greedy_tokens(tiny_colocated):
    reply = chat_logprobs(tiny_colocated)
    ChatCompletion.model_validate(reply.model_dump())
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 12
    assert b"".join(bytes(c.bytes) for c in content).decode() == reply.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob <= 0
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy: the best


def test_logprobs_are_the_same_disaggregated_and_streamed(tiny_colocated, tiny_disaggregated):
    want = chat_logprobs(tiny_colocated).choices[0].logprobs.content
    got = chat_logprobs(tiny_disaggregated).choices[0].logprobs.content
    assert [c.token for c in got] == [c.token for c in want]
    assert [c.logprob for c in got] == pytest.approx([c.logprob for c in want], abs=1e-4)
    stream = tiny_disaggregated.client().chat.completions.create(model="llama", messages=CHAT, logprobs=True,
                                                            top_logprobs=3, stream=True, **GREEDY)
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in want]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in want], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_legacy_completion_logprobs(tiny_disaggregated, stream):
    kw = GREEDY | {"logprobs": 2}
    client = tiny_disaggregated.client()
    if stream:
        chunks = list(client.completions.create(model="llama", prompt="Once upon a time", stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        offsets = [o for p in parts for o in p.text_offset]
        top = [d for p in parts for d in p.top_logprobs]
        token_logprobs = [v for p in parts for v in p.token_logprobs]
    else:
        reply = client.completions.create(model="llama", prompt="Once upon a time", **kw)
        Completion.model_validate(reply.model_dump())
        text, lp = reply.choices[0].text, reply.choices[0].logprobs
        tokens, offsets, top, token_logprobs = lp.tokens, lp.text_offset, lp.top_logprobs, lp.token_logprobs
    assert len(tokens) == len(token_logprobs) == len(top) == 12
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert "".join(tokens) == text
    for token, value, best in zip(tokens, token_logprobs, top, strict=True):
        assert len(best) <= 2 and max(best.values()) == pytest.approx(value) and best.get(token) == value


def greedy_tokens(server: Server, **extra) -> list[tuple[int, ...]]:
    """The greedy chat completion's tokens, each as its bytes (from its logprobs)."""
    reply = server.client().chat.completions.create(model="llama", messages=CHAT, logprobs=True,
                                                    **(GREEDY | {"extra_body": {"ignore_eos": True, **extra}}))
    return [tuple(c.bytes) for c in reply.choices[0].logprobs.content]


def token_id(server: Server, spelled: tuple[int, ...] | str) -> int:
    text = spelled if isinstance(spelled, str) else bytes(spelled).decode()
    ids = raw(server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert len(ids) == 1, "this token's text must tokenize back to one id"
    return ids[0]


def test_penalties_bias_min_tokens_and_stop_token_ids_change_the_greedy_tokens_alike_on_both_servers(
        tiny_colocated, tiny_disaggregated):
    plain = greedy_tokens(tiny_colocated)
    forced = next(t for t in plain if bytes(t).isascii() and bytes(t).strip())
    for server in (tiny_colocated, tiny_disaggregated):
        assert greedy_tokens(server) == plain
        # a large logit_bias makes one token win every step
        assert set(greedy_tokens(server, logit_bias={str(token_id(server, forced)): 100})) == {forced}
        # a repetition penalty below 1 (an encouragement) makes the tokens so far win again
        encouraged = greedy_tokens(server, repetition_penalty=0.2)
        assert len(set(encouraged)) < len(encouraged) and len(set(plain)) == len(plain)
    # the same shaped tokens on both servers (prefill shapes the first token, decode the rest); the penalties'
    # arithmetic is tests/test_sampler.py's
    shaped = {"frequency_penalty": -2, "presence_penalty": -2, "repetition_penalty": 0.5, "min_p": 0.5}
    assert greedy_tokens(tiny_colocated, **shaped) == greedy_tokens(tiny_disaggregated, **shaped) != plain


def test_stop_token_ids_end_the_request_and_min_tokens_holds_them_off(tiny_disaggregated):
    client = tiny_disaggregated.client()
    plain = client.completions.create(model="llama", prompt="Once upon a time", logprobs=0, **GREEDY)
    tokens = plain.choices[0].logprobs.tokens
    at = 3
    stop_id = token_id(tiny_disaggregated, tokens[at])
    first = tokens.index(tokens[at])
    stopped = client.completions.create(model="llama", prompt="Once upon a time",
                                        **(GREEDY | {"extra_body": {"ignore_eos": True, "stop_token_ids": [stop_id]}}))
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == first + 1
    assert plain.choices[0].text.startswith(stopped.choices[0].text)
    held = client.completions.create(model="llama", prompt="Once upon a time", logprobs=0, **(
        GREEDY | {"extra_body": {"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": first + 2}}))
    assert held.usage.completion_tokens >= first + 2
    assert tokens[at] not in held.choices[0].logprobs.tokens[: first + 2]


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
])
def test_bad_sampling_values_are_400s_naming_the_param(tiny_disaggregated, body, param):
    resp = raw(tiny_disaggregated, "/v1/chat/completions", {"messages": CHAT} | body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        tiny_disaggregated.client().chat.completions.create(model="llama", messages=CHAT, extra_body=body)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_returns_the_prompt_and_its_logprobs_line_up_with_generation(tiny_colocated, tiny_disaggregated, stream):
    """A prompt token's echoed logprob is the logprob the model gave that token when it generated it."""
    prompt = [1000 + 37 * i for i in range(20)]  # token ids; 20 tokens spans two pages
    for server in (tiny_colocated, tiny_disaggregated):
        client = server.client()
        first = client.completions.create(model="llama", prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
        generated = first.choices[0].logprobs.token_logprobs[0]
        token = token_id(server, first.choices[0].logprobs.tokens[0])
        kw = {"model": "llama", "prompt": prompt + [token], "max_tokens": 3, "temperature": 0, "echo": True,
              "logprobs": 2, "extra_body": {"ignore_eos": True}}
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
            text = "".join(c.text for c in chunks)
            values = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
            top = [d for c in chunks if c.logprobs for d in c.logprobs.top_logprobs]
        else:
            reply = client.completions.create(**kw)
            # The first prompt token has no logprob: null, as OpenAI's API and vLLM answer, though the openai
            # package's type says float; everything else validates.
            dump = reply.model_dump()
            for key in ("token_logprobs", "top_logprobs"):
                assert dump["choices"][0]["logprobs"][key].pop(0) is None
            Completion.model_validate(dump)
            text, values, top = (reply.choices[0].text, reply.choices[0].logprobs.token_logprobs,
                                 reply.choices[0].logprobs.top_logprobs)
        echoed = raw(server, "/detokenize", {"tokens": prompt + [token]}).json()["prompt"]
        assert text.startswith(echoed) and len(text) > len(echoed)
        assert len(values) == len(prompt) + 1 + 3 and values[0] is None and top[0] is None
        assert values[len(prompt)] == pytest.approx(generated, abs=1e-4)
        assert all(len(d) <= 2 and max(d.values()) >= v for d, v in zip(top[1:], values[1:], strict=True))


def test_echo_without_logprobs_is_the_prompt_text_then_the_completion(tiny_disaggregated):
    client = tiny_disaggregated.client()
    plain = client.completions.create(model="llama", prompt="Once upon a time", **GREEDY)
    echoed = client.completions.create(model="llama", prompt="Once upon a time", echo=True, **GREEDY)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None and echoed.usage == plain.usage
