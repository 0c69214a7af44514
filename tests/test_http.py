"""The HTTP layer against a scripted fake engine: mapping, admission, SSE, errors, disconnects.

Two kinds of client: httpx over ASGI (fast, exact bodies) and the official
``openai`` SDK against a real uvicorn server (its parsing of streams and
errors). Disconnect tests use raw sockets against uvicorn, since only a real
connection can go away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import jinja2
import openai
import pytest
import uvicorn

from kvfence.core import ContextLengthExceeded, FinishReason, InvalidRequest, Request, RequestOutput, ServiceUnavailable
from kvfence.router.app import create_app
from kvfence.router.edge import uvicorn_config
from kvfence.router.limits import EdgeLimits
from kvfence.router.tenants import Tenants
from tests.server import wait_until

pytestmark = pytest.mark.fast


MODEL = "fake-model"
KEYS = {"alice": ["sk-alice"], "bob": ["sk-bob"]}
ERROR_KEYS = {"message", "type", "param", "code"}


class FakeTokenizer:
    """One token per byte. Template: ``<role>content`` per message, then ``<assistant>``."""

    eos_token_ids = frozenset({0})
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise jinja2.TemplateError("tool messages are not supported by this template")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def template(*pairs: tuple[str, str]) -> list[int]:
    return FakeTokenizer().encode("".join(f"<{r}>{c}" for r, c in pairs) + "<assistant>")


class FakeEngine:
    """A scripted ``EngineClient``.

    Yields one output per piece (token id 100+i), the last with ``finish``.
    ``fail`` is raised instead of output ``fail_at``; ``block_at`` waits forever
    instead of yielding that output. ``ending`` records how ``generate`` ended:
    "finished" once its last output was delivered, else the exception's name
    (GeneratorExit from aclose, CancelledError from a cancelled await).
    """

    model_name = MODEL

    def __init__(self, pieces=("Hel", "lo", " world"), finish=FinishReason.STOP, max_context=64,
                 fail: BaseException | None = None, fail_at: int = 0, block_at: int | None = None,
                 outputs: list[RequestOutput] | None = None) -> None:
        self.pieces, self.finish, self.max_context = pieces, finish, max_context
        self.fail, self.fail_at, self.block_at, self.outputs = fail, fail_at, block_at, outputs
        self.requests: list[Request] = []
        self.ending: str | None = None
        self.blocked = threading.Event()
        self.ended = threading.Event()

    async def generate(self, request: Request):
        self.requests.append(request)
        delivered_last = False
        try:
            for i, out in enumerate(self._script(request)):
                if self.fail is not None and i == self.fail_at:
                    raise self.fail
                if i == self.block_at:
                    self.blocked.set()
                    await asyncio.sleep(3600)
                delivered_last = out.finished
                yield out
            self.ending = "exhausted"
        except BaseException as e:
            self.ending = "finished" if delivered_last else type(e).__name__
            raise
        finally:
            self.ended.set()

    def _script(self, request: Request) -> list[RequestOutput]:
        if self.outputs is not None:
            return self.outputs
        n = len(self.pieces)
        return [
            RequestOutput(request.rid, [100 + i], p, self.finish if i == n - 1 else None,
                          prompt_tokens=request.prompt_len, completion_tokens=i + 1)
            for i, p in enumerate(self.pieces)
        ]

    def health(self) -> dict:
        return {"mode": "fake", "running": 0}


def make_app(engine: FakeEngine, tenants: Tenants | None = None, limits: EdgeLimits | None = None, **kw):
    return create_app(engine, kw.pop("tokenizer", FakeTokenizer()), tenants or Tenants.open(), limits=limits, **kw)


@contextlib.asynccontextmanager
async def asgi_client(engine: FakeEngine, tenants: Tenants | None = None):
    transport = httpx.ASGITransport(app=make_app(engine, tenants))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


def chat_body(content="hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def sse_events(text: str) -> list:
    """Parse an SSE body strictly: every event is one ``data:`` line followed by a blank line."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error(resp: httpx.Response, status: int, type: str, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    err = body["error"]
    assert (err["type"], err["param"], err["code"]) == (type, param, code)
    assert isinstance(err["message"], str) and err["message"]
    return err


# -- ASGI: success paths ---------------------------------------------------------


@pytest.mark.anyio
async def test_models_and_health():
    async with asgi_client(FakeEngine()) as c:
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list"
        [card] = models["data"]
        assert card | {"created": 0} == {"id": MODEL, "object": "model", "created": 0, "owned_by": "kvfence",
                                        "root": MODEL, "parent": None, "max_model_len": 64}
        assert (await c.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
        assert_error(await c.get("/v1/models/other"), 404, "invalid_request_error", "model", "model_not_found")
        health = await c.get("/health")
        assert health.status_code == 200
        assert health.json() == {"status": "ok"}  # open mode has no admin key: nobody sees the detail
    engine = FakeEngine()
    engine.health = lambda: {"status": "engine thread stopped"}
    async with asgi_client(engine) as c:
        assert (await c.get("/health")).status_code == 503


@pytest.mark.anyio
async def test_chat_completion_body_and_engine_request():
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(max_tokens=5))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    [req] = engine.requests
    prompt = template(("user", "hi"))
    assert req.prompt_ids == prompt and req.tenant == "default"
    assert body["id"] == f"chatcmpl-{req.rid:032x}"
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert abs(body["created"] - time.time()) < 60
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello world"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.ending == "finished"


@pytest.mark.anyio
async def test_sampling_fields_map_into_params():
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        await c.post("/v1/chat/completions", json=chat_body(
            max_tokens=9, temperature=0, top_p=0.5, top_k=7, seed=1234, stop="END", ignore_eos=True))
        await c.post("/v1/chat/completions", json=chat_body(
            max_tokens=9, max_completion_tokens=4, stop=["a", "bc"], top_k=-1, temperature=None))
        await c.post("/v1/chat/completions", json=chat_body())
    p1, p2, p3 = (r.params for r in engine.requests)
    assert (p1.max_tokens, p1.temperature, p1.top_p, p1.top_k, p1.seed, p1.stop, p1.ignore_eos) == (
        9, 0.0, 0.5, 7, 1234, ("END",), True)
    assert p1.greedy
    assert (p2.max_tokens, p2.stop, p2.top_k, p2.temperature) == (4, ("a", "bc"), 0, 1.0)  # max_completion_tokens wins
    assert not p2.greedy
    prompt_len = len(template(("user", "hi")))
    assert (p3.max_tokens, p3.temperature, p3.top_p, p3.top_k, p3.seed, p3.stop, p3.ignore_eos) == (
        64 - prompt_len, 1.0, 1.0, 0, None, (), False)  # omitted max_tokens: up to the context limit


@pytest.mark.anyio
async def test_content_parts_and_roles_reach_the_template():
    engine = FakeEngine()
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    async with asgi_client(engine) as c:
        resp = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert resp.status_code == 200
    assert engine.requests[0].prompt_ids == template(("system", "be brief"), ("user", "a\nb"), ("assistant", ""))


@pytest.mark.anyio
async def test_completions_with_text_and_token_prompts():
    engine = FakeEngine(finish=FinishReason.LENGTH)
    async with asgi_client(engine) as c:
        r1 = await c.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3})
        r2 = await c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3})
        r3 = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["xy"], "max_tokens": 3})
        r4 = await c.post("/v1/completions", json={"model": MODEL, "prompt": [[9, 9]], "max_tokens": 3})
    assert [r.status_code for r in (r1, r2, r3, r4)] == [200] * 4
    assert [r.prompt_ids for r in engine.requests] == [list(b"abc"), [5, 6, 7, 8], list(b"xy"), [9, 9]]
    body = r1.json()
    assert body["id"] == f"cmpl-{engine.requests[0].rid:032x}" and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert r2.json()["usage"]["prompt_tokens"] == 4


# -- ASGI: streaming -----------------------------------------------------------


@pytest.mark.anyio
async def test_chat_stream_order_usage_and_done():
    engine = FakeEngine(pieces=("Hel", "", "lo"))  # an empty delta (held-back text) sends no chunk
    async with asgi_client(engine) as c:
        resp = await c.post("/v1/chat/completions",
                            json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    rid = engine.requests[0].rid
    for chunk in chunks:
        assert (chunk["id"], chunk["object"], chunk["model"]) == (f"chatcmpl-{rid:032x}", "chat.completion.chunk",
                                                                  MODEL)
        assert "usage" in chunk
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
        [],
    ]
    prompt_len = len(template(("user", "hi")))
    assert [c["usage"] for c in chunks] == [None] * 4 + [
        {"prompt_tokens": prompt_len, "completion_tokens": 3, "total_tokens": prompt_len + 3,
         "prompt_tokens_details": {"cached_tokens": 0}}]
    assert engine.ending == "finished"


@pytest.mark.anyio
async def test_completion_stream_without_usage():
    engine = FakeEngine(pieces=("a", "b"), finish=FinishReason.LENGTH)
    async with asgi_client(engine) as c:
        resp = await c.post("/v1/completions", json={"prompt": "p", "stream": True, "max_tokens": 2})
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e and e["object"] == "text_completion" for e in events[:-1])
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "b", ""]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, "length"]


# -- ASGI: admission -------------------------------------------------------------


@pytest.mark.anyio
async def test_context_length_is_checked_before_the_engine():
    engine = FakeEngine()
    text = "x" * 40
    prompt_len = len(template(("user", text)))  # 57 of the 64
    async with asgi_client(engine) as c:
        over = await c.post("/v1/chat/completions", json=chat_body(text, max_tokens=64 - prompt_len + 1))
        err = assert_error(over, 400, "invalid_request_error", "messages", "context_length_exceeded")
        assert engine.requests == []
        assert "maximum context length is 64 tokens" in err["message"]
        assert f"requested 65 tokens ({prompt_len} in the messages, 8 in the completion)" in err["message"]

        fits = await c.post("/v1/chat/completions", json=chat_body(text, max_tokens=64 - prompt_len))
        assert fits.status_code == 200
        assert engine.requests[0].params.max_tokens == 7

        full = "x" * (64 - len(template(("user", ""))))  # the prompt alone fills the context
        alone = await c.post("/v1/chat/completions", json=chat_body(full))
        err = assert_error(alone, 400, "invalid_request_error", "messages", "context_length_exceeded")
        assert "requested 65 tokens (64 in the messages, 1 in the completion)" in err["message"]

        ids = await c.post("/v1/completions", json={"prompt": list(range(60)), "max_tokens": 5})
        assert_error(ids, 400, "invalid_request_error", "prompt", "context_length_exceeded")
    assert len(engine.requests) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("prompt", ["", [], [[]], [""]])
async def test_empty_prompt_is_400(prompt):
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        resp = await c.post("/v1/completions", json={"prompt": prompt})
    assert "empty" in assert_error(resp, 400, "invalid_request_error", "prompt")["message"]
    assert engine.requests == []


@pytest.mark.anyio
async def test_several_prompts_are_400():
    async with asgi_client(FakeEngine()) as c:
        for prompt in (["a", "b"], [[1], [2]]):
            resp = await c.post("/v1/completions", json={"prompt": prompt})
            assert "only one prompt" in assert_error(resp, 400, "invalid_request_error", "prompt")["message"]


# -- ASGI: errors ----------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    "patch, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream": "yes please"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools.[0].function"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"the": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.[0]"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages.[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.[0].content"),
        ({"messages": [{"content": "hi"}]}, "messages.[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # the template refuses it
    ],
)
async def test_bad_fields_are_400_naming_the_param(patch, param):
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body() | patch)
    assert_error(resp, 400, "invalid_request_error", param)
    assert engine.requests == []


@pytest.mark.anyio
async def test_neutral_values_of_unsupported_fields_are_fine():
    engine = FakeEngine()
    neutral = {"logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "response_format": {"type": "text"},
               "tools": None, "n": 1, "user": "u1", "store": False, "parallel_tool_calls": True}
    async with asgi_client(engine) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body() | neutral)).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("field", ["some_vendor_field", "guided_json", "structured_outputs", "lora_path", "priority",
                                   "chat_template_kwargs", "return_hidden_states"])
async def test_unknown_fields_are_400_naming_them_as_openai_does(field):
    """vLLM and SGLang extensions included: an answer must never come from a request partly ignored."""
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body() | {field: {"x": 1}})
        err = assert_error(resp, 400, "invalid_request_error", field)
        assert err["message"] == f"Unrecognized request argument supplied: {field}"
        nested = await c.post("/v1/chat/completions",
                              json=chat_body(messages=[{"role": "user", "content": "hi", field: 1}]))
        assert_error(nested, 400, "invalid_request_error", f"messages.[0].{field}")
        history = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}]}]
        calls = await c.post("/v1/chat/completions", json=chat_body(messages=history))
        assert_error(calls, 400, "invalid_request_error", "messages.[0].tool_calls.[0].function")  # malformed
    assert engine.requests == []


@pytest.mark.anyio
async def test_malformed_json_missing_fields_and_non_objects():
    async with asgi_client(FakeEngine()) as c:
        headers = {"content-type": "application/json"}
        bad = await c.post("/v1/chat/completions", content=b'{"model": ', headers=headers)
        assert "not valid JSON" in assert_error(bad, 400, "invalid_request_error")["message"]
        missing = await c.post("/v1/chat/completions", json={"model": MODEL})
        assert assert_error(missing, 400, "invalid_request_error", "messages")["message"] == (
            "Missing required parameter: 'messages'.")
        listed = await c.post("/v1/chat/completions", json=[1, 2])
        assert "JSON object" in assert_error(listed, 400, "invalid_request_error")["message"]
        empty = await c.post("/v1/completions", content=b"", headers=headers)
        assert_error(empty, 400, "invalid_request_error")


@pytest.mark.anyio
async def test_unknown_model_and_route_are_404():
    async with asgi_client(FakeEngine()) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body() | {"model": "gpt-9"})
        assert "gpt-9" in assert_error(resp, 404, "invalid_request_error", "model", "model_not_found")["message"]
        resp = await c.post("/v1/embeddings", json={})
        assert assert_error(resp, 404, "invalid_request_error")["message"] == "Invalid URL (POST /v1/embeddings)"
        resp = await c.get("/v1/chat/completions")
        assert_error(resp, 405, "invalid_request_error")
        ok = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200  # model omitted: the served one


@pytest.mark.anyio
async def test_auth_is_required_and_checked_before_the_body():
    engine = FakeEngine()
    tenants = Tenants(KEYS)
    async with asgi_client(engine, tenants) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body())
        assert_error(resp, 401, "authentication_error", None, "invalid_api_key")
        resp = await c.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sk-nope"})
        assert "Incorrect API key" in assert_error(resp, 401, "authentication_error", None, "invalid_api_key")[
            "message"]
        resp = await c.post("/v1/chat/completions", json={"bad": 1}, headers={"Authorization": "Bearer sk-nope"})
        assert resp.status_code == 401
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/health")).status_code == 200
        for key, tenant in (("sk-bob", "bob"), ("sk-alice", "alice")):
            resp = await c.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 200
            assert engine.requests[-1].tenant == tenant
    assert len(engine.requests) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_rejection_before_first_token_keeps_its_status(stream):
    """I3: an engine-side reject is the client's status even for streams, never a 200."""
    engine = FakeEngine(fail=ContextLengthExceeded(700, 10, 681, what="KV pool"))
    async with asgi_client(engine) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(stream=stream))
    err = assert_error(resp, 400, "invalid_request_error", "messages", "context_length_exceeded")
    assert "maximum KV pool is 681 tokens" in err["message"]
    assert engine.ending == "ContextLengthExceeded"


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_error_carried_on_an_output_is_raised(stream):
    outputs = [RequestOutput(1, [], "", error=ServiceUnavailable("worker gone", code="worker_lost"))]
    async with asgi_client(FakeEngine(outputs=outputs)) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(stream=stream))
    assert_error(resp, 503, "service_unavailable", None, "worker_lost")


@pytest.mark.anyio
async def test_abort_or_error_finish_is_never_a_200():
    for finish, status in ((FinishReason.ABORT, 503), (FinishReason.ERROR, 500)):
        async with asgi_client(FakeEngine(pieces=("a", "b"), finish=finish)) as c:
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == status


class PlaceholderEngine(FakeEngine):
    """The incident's bug: the engine swaps the prompt for a 1-token placeholder and answers anyway."""

    def _script(self, request: Request) -> list[RequestOutput]:
        request.prompt_ids = [0]
        return super()._script(request)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_computing_another_prompt_is_an_integrity_error(stream):
    """Outputs for a prompt other than the admitted one are a 500, and none of their text is sent."""
    async with asgi_client(PlaceholderEngine()) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(stream=stream))
    err = assert_error(resp, 500, "internal_error", None, "kv_integrity")
    assert f"reported 1 prompt tokens for a {len(template(('user', 'hi')))}-token prompt" in err["message"]
    assert "Hel" not in resp.text


@pytest.mark.anyio
async def test_lone_surrogate_is_400():
    async with asgi_client(FakeEngine()) as c:
        body = b'{"messages": [{"role": "user", "content": "\\ud800"}]}'
        resp = await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert_error(resp, 400, "invalid_request_error", "messages.[0].content")
        body = b'{"prompt": "a\\udfffb"}'
        resp = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert_error(resp, 400, "invalid_request_error", "prompt")


@pytest.mark.anyio
async def test_engine_error_mid_stream_is_an_error_event_then_done():
    engine = FakeEngine(fail=InvalidRequest("went wrong", code="boom"), fail_at=1)
    async with asgi_client(engine) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(stream=True))
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "went wrong", "type": "invalid_request_error", "param": None,
                                    "code": "boom"}}
    assert [e["choices"][0]["delta"] for e in events[:-2]] == [{"role": "assistant", "content": ""},
                                                               {"content": "Hel"}]


@pytest.mark.anyio
async def test_unexpected_exceptions_are_500_in_openai_format(caplog):
    async with asgi_client(FakeEngine(fail=RuntimeError("kaboom"))) as c:
        with caplog.at_level(logging.ERROR, logger="kvfence.router"):
            resp = await c.post("/v1/chat/completions", json=chat_body())
    err = assert_error(resp, 500, "internal_error")
    assert "kaboom" not in err["message"]
    assert "kaboom" in caplog.text  # the traceback is logged

    async with asgi_client(FakeEngine(fail=RuntimeError("kaboom"), fail_at=2)) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(stream=True))
    events = sse_events(resp.text)
    assert events[-2]["error"]["type"] == "internal_error" and events[-1] == "[DONE]"


@pytest.mark.anyio
async def test_one_log_line_per_request(caplog):
    engine = FakeEngine()
    tenants = Tenants(KEYS)
    with caplog.at_level(logging.INFO, logger="kvfence.router"):
        async with asgi_client(engine, tenants) as c:
            auth = {"Authorization": "Bearer sk-bob"}
            await c.post("/v1/chat/completions", json=chat_body(), headers=auth)
            await c.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth)
            await c.post("/v1/chat/completions", json=chat_body("x" * 100), headers=auth)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvfence.router"]
    assert len(lines) == 3
    first, second = engine.requests
    prompt_len = len(template(("user", "hi")))
    assert lines[0] == (f"request tenant=bob rid={first.rid:032x} prompt_tokens={prompt_len} "
                        "completion_tokens=3 status=200")
    assert lines[1].startswith(f"request tenant=bob rid={second.rid:032x}") and lines[1].endswith("status=200")
    assert lines[2].endswith("completion_tokens=0 status=400")


# -- real server: the openai SDK and disconnects ----------------------------------------------


SERVED: dict[str, uvicorn.Server] = {}  # base URL -> the server ``serving`` runs there


def open_connections(url: str) -> int:
    """The connections from 127.0.0.1 that the edge ``serving`` runs at ``url`` counts (EdgeProtocol's one count
    per client address): what a test waits on instead of sleeping until the server has seen a connect or a close."""
    return SERVED[url].config.http.keywords["clients"]["127.0.0.1"]


@contextlib.contextmanager
def serving(engine: FakeEngine, tenants: Tenants | None = None, limits: EdgeLimits | None = None,
            **kw) -> Iterator[str]:
    """Run the app under uvicorn behind the edge's protocol, as ``kvfence serve`` does, on a free 127.0.0.1 port in
    a thread; yield its base URL. ``kw`` go to ``create_app``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    limits = limits or EdgeLimits()
    server = uvicorn.Server(uvicorn_config(make_app(engine, tenants, limits, **kw), limits, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 10, "uvicorn to start")
    assert server.started, "uvicorn did not start"
    url = f"http://127.0.0.1:{port}"
    SERVED[url] = server
    try:
        yield url
    finally:
        del SERVED[url]
        server.should_exit = True
        thread.join(10)
        sock.close()


def sdk(url: str, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


def test_openai_sdk_chat_completions_and_models():
    engine = FakeEngine()
    with serving(engine, Tenants(KEYS)) as url:
        client = sdk(url)
        assert [m.id for m in client.models.list()] == [MODEL]
        done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0, seed=3, stop=["zz"])
        assert done.choices[0].message.content == "Hello world"
        assert done.choices[0].finish_reason == "stop"
        assert done.usage.completion_tokens == 3
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
        assert chunks[-1].usage.total_tokens == len(template(("user", "hi"))) + 3
        text = client.completions.create(model=MODEL, prompt="abc", max_tokens=3)
        assert text.choices[0].text == "Hello world"
        assert "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="a", stream=True)) \
            == "Hello world"
    assert [r.tenant for r in engine.requests] == ["alice"] * 4
    assert engine.requests[0].params.stop == ("zz",) and engine.requests[0].params.greedy


def test_openai_sdk_errors():
    engine = FakeEngine()
    with serving(engine, Tenants(KEYS)) as url:
        client = sdk(url)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 100}])
        assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=100)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=17)
        assert e.value.param == "n"
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "model_not_found"
        with pytest.raises(openai.AuthenticationError):
            sdk(url, key="sk-wrong").models.list()
        assert engine.requests == []


def test_openai_sdk_sees_an_error_event_mid_stream():
    engine = FakeEngine(fail=ServiceUnavailable("decode worker lost"), fail_at=1)
    with serving(engine) as url:
        stream = sdk(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  stream=True)
        with pytest.raises(openai.APIError, match="decode worker lost"):
            list(stream)


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before {marker!r}; got {got!r}"
        got += chunk
    return got


@pytest.mark.parametrize(
    "path, body, block_at, read_first",
    [
        ("/v1/chat/completions", chat_body(), 1, None),  # non-streaming, waiting for the engine
        ("/v1/chat/completions", chat_body(stream=True), 0, None),  # stream, before the first token
        ("/v1/chat/completions", chat_body(stream=True), 2, b'"lo"'),  # stream, mid-way
        ("/v1/completions", {"prompt": "p", "stream": True}, 1, b'"Hel"'),
    ],
)
def test_client_disconnect_closes_the_engine_iterator(caplog, path, body, block_at, read_first):
    engine = FakeEngine(block_at=block_at)
    with caplog.at_level(logging.INFO, logger="kvfence.router"), serving(engine) as url:
        sock = raw_post(url, path, body)
        if read_first:
            read_until(sock, read_first)
        assert engine.blocked.wait(10)
        sock.close()
        assert engine.ended.wait(10), "the engine iterator was never closed"
        deadline = time.monotonic() + 5
        while "status=499" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert engine.ending == "CancelledError"
    assert "status=499" in caplog.text


@pytest.mark.anyio
async def test_cache_salt_reaches_the_engine_and_cached_tokens_the_usage():
    """``cache_salt`` (vLLM's field) scopes the prefix cache with the tenant; the first output's ``cached_tokens``
    is the usage's ``prompt_tokens_details.cached_tokens``, whole and streamed."""
    outputs = [RequestOutput(1, [100], "Hi", completion_tokens=1, cached_tokens=16),
               RequestOutput(1, [101], "!", FinishReason.STOP, completion_tokens=2)]
    engine = FakeEngine(outputs=outputs)
    async with asgi_client(engine) as c:
        body = (await c.post("/v1/chat/completions", json=chat_body(cache_salt="s1"))).json()
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
        stream = await c.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "stream": True,
                                                       "stream_options": {"include_usage": True}})
        last = json.loads(stream.text.split("data: ")[-2])
        assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
        assert [r.cache_salt for r in engine.requests] == ["s1", None]
        for salt in ("", 5, ["a"]):
            resp = await c.post("/v1/chat/completions", json=chat_body(cache_salt=salt))
            assert_error(resp, 400, "invalid_request_error", "cache_salt")
