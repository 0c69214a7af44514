"""The HTTP edge: strict bodies, invalid Unicode, size caps, timeouts, path aliasing, fairness, least exposure.

In process (httpx over ASGI, or the ASGI app fed by hand) where the app decides; a real uvicorn server behind
``EdgeProtocol`` with raw sockets where the connection decides (slow, huge or stalled clients). The scripted
``FakeEngine`` of ``test_http`` stands in for the engine; a real ``kvfence serve`` is in ``test_edge_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvfence.auditlog import AuditLog, AuditRecord, read_records
from kvfence.core import Request, RequestOutput, SamplingParams, ServiceUnavailable
from kvfence.protocol.router import RouterCore
from kvfence.router import app as app_module
from kvfence.router.app import _error_response, create_app
from kvfence.router.exposure import FailedLogins, redact
from kvfence.router.fair import FairPool, TooManyRequests
from kvfence.router.limits import EdgeLimits, default_max_request_bytes
from kvfence.router.metrics import Metrics
from kvfence.router.tenants import Tenants
from kvfence.safety import Safety
from tests.server import async_wait_until, wait_until
from tests.test_admin import ADMIN, ADMIN_KEY, ALICE, BOB, hello
from tests.test_http import KEYS, MODEL, FakeEngine, FakeTokenizer, assert_error, chat_body, open_connections, serving

JSON = {"content-type": "application/json"}


def tenants() -> Tenants:
    return Tenants(KEYS, admin_keys=[ADMIN_KEY])


@contextlib.asynccontextmanager
async def asgi(engine: FakeEngine, audit: AuditLog | None = None, limits: EdgeLimits | None = None,
               tokenizer=None, keys: Tenants | None = None):
    app = create_app(engine, tokenizer or FakeTokenizer(), keys or tenants(), audit, limits)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client


def read_log(path: Path) -> list[AuditRecord]:
    problems: list[str] = []
    records = list(read_records(path.read_bytes().splitlines(), problems)) if path.exists() else []
    assert problems == []
    return records


# -- strict validation -------------------------------------------------------------------------------------------

MESSAGES = '"messages": [{"role": "user", "content": "hi"}]'
NON_FINITE = ["1e400", "-1e400", "NaN", "Infinity", "-Infinity"]
WRONG_TYPES = [
    ('"max_tokens": "5"', "max_tokens"), ('"max_tokens": true', "max_tokens"), ('"max_tokens": 5.0', "max_tokens"),
    ('"max_completion_tokens": "5"', "max_completion_tokens"), ('"temperature": true', "temperature"),
    ('"temperature": "0.5"', "temperature"), ('"top_p": false', "top_p"), ('"top_k": 2.0', "top_k"),
    ('"top_k": 99999999999', "top_k"), ('"seed": 1.5', "seed"), ('"seed": "7"', "seed"), ('"n": true', "n"),
    ('"stream": "yes"', "stream"), ('"stream": 1', "stream"), ('"ignore_eos": "true"', "ignore_eos"),
    ('"user": 5', "user"), ('"model": 5', "model"), ('"stop": 5', "stop"), ('"logprobs": 0', "logprobs"),
    ('"presence_penalty": true', "presence_penalty"), ('"logit_bias": {"5": "x"}', "logit_bias.5"),
    ('"stream": true, "stream_options": {"include_usage": 1}', "stream_options.include_usage"),
    ('"stream": true, "stream_options": []', "stream_options"),
]


async def post_raw(c: httpx.AsyncClient, path: str, body: str | bytes, headers: dict | None = None) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    return await c.post(path, content=data, headers=JSON | (headers or ALICE))


@pytest.mark.fast
@pytest.mark.anyio
async def test_non_finite_numbers_anywhere_are_400_at_once_and_recorded(tmp_path):
    engine, path = FakeEngine(), tmp_path / "audit.jsonl"
    bodies = []
    for number in NON_FINITE:
        bodies += [(f'{{{MESSAGES}, "temperature": {number}}}', "temperature"),
                   (f'{{{MESSAGES}, "top_p": {number}}}', "top_p"),
                   (f'{{{MESSAGES}, "vendor": {{"x": [1, {number}]}}}}', "vendor.x.[1]"),
                   (f'{{{MESSAGES}, "presence_penalty": {number}}}', "presence_penalty")]
    with AuditLog(path) as audit:
        async with asgi(engine, audit) as c:
            for body, param in bodies:
                started = time.monotonic()
                resp = await post_raw(c, "/v1/chat/completions", body)
                assert time.monotonic() - started < 1
                err = assert_error(resp, 400, "invalid_request_error", param)
                assert "finite" in err["message"]
            resp = await post_raw(c, "/v1/completions", '{"prompt": "hi", "temperature": 1e400}')
            assert_error(resp, 400, "invalid_request_error", "temperature")
    assert engine.requests == []
    records = read_log(path)
    assert [(r.tenant, r.status, r.admission) for r in records] == [("alice", 400, "rejected")] * (len(bodies) + 1)


@pytest.mark.fast
@pytest.mark.anyio
@pytest.mark.parametrize("field, param", WRONG_TYPES)
async def test_wrong_json_types_are_400_naming_the_param(field, param):
    engine = FakeEngine()
    async with asgi(engine) as c:
        assert_error(await post_raw(c, "/v1/chat/completions", f"{{{MESSAGES}, {field}}}"), 400,
                     "invalid_request_error", param)
        if param not in ("logprobs", "max_completion_tokens"):  # for completions: an integer (0 is off); unknown
            assert_error(await post_raw(c, "/v1/completions", f'{{"prompt": "hi", {field}}}'), 400,
                         "invalid_request_error", param)
    assert engine.requests == []


@pytest.mark.fast
@pytest.mark.anyio
@pytest.mark.parametrize("field, param", [
    ('"messages": [{"role": 5, "content": "hi"}]', "messages.[0].role"),
    ('"messages": [{"role": "user", "content": "hi", "name": 5}]', "messages.[0].name"),
    ('"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]', "messages.[0].content"),
    ('"messages": {"role": "user", "content": "hi"}', "messages"),
])
async def test_nested_message_fields_are_typed_strictly(field, param):
    async with asgi(FakeEngine()) as c:
        assert_error(await post_raw(c, "/v1/chat/completions", f"{{{field}}}"), 400, "invalid_request_error", param)


@pytest.mark.fast
@pytest.mark.anyio
async def test_floats_may_be_json_integers_and_the_neutral_values_pass():
    engine = FakeEngine()
    async with asgi(engine) as c:
        resp = await post_raw(c, "/v1/chat/completions", f'{{{MESSAGES}, "temperature": 1, "top_p": 1, '
                                                         '"presence_penalty": 0, "frequency_penalty": 0.0, '
                                                         '"logprobs": false, "seed": -3, "max_tokens": 2}')
        assert resp.status_code == 200, resp.text
    assert (engine.requests[0].params.temperature, engine.requests[0].params.seed) == (1.0, -3)


@pytest.mark.fast
@pytest.mark.anyio
@pytest.mark.parametrize("body", [b'{"messages": ', b"", b"[1, 2]", b'"hi"', b"\xff\xfe{}", b"[" * 100_000,
                                  b'{"prompt": ' + b"9" * 5000 + b"}"])
async def test_malformed_bodies_are_400_and_recorded(tmp_path, body):
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as audit:
        async with asgi(FakeEngine(), audit) as c:
            assert_error(await post_raw(c, "/v1/completions", body), 400, "invalid_request_error")
    [record] = read_log(path)
    assert (record.tenant, record.status, record.endpoint, record.model) == ("alice", 400, "/v1/completions", MODEL)


# -- invalid Unicode ------------------------------------------------------------------------------------------------

SURROGATE = "\\ud800"
SURROGATE_CASES = [
    ("/v1/chat/completions", f'{{{MESSAGES}, "stop": "{SURROGATE}"}}', "stop"),
    ("/v1/chat/completions", f'{{{MESSAGES}, "stop": ["ok", "a{SURROGATE}"]}}', "stop.[1]"),
    ("/v1/chat/completions", f'{{{MESSAGES}, "model": "{SURROGATE}"}}', "model"),
    ("/v1/chat/completions", f'{{{MESSAGES}, "user": "x\\udfff"}}', "user"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
     "messages.[0].content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{SURROGATE}"}}]'
                             f'}}]}}', "messages.[0].content.[0].text"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi", "name": "{SURROGATE}"}}]}}',
     "messages.[0].name"),
    ("/v1/chat/completions", f'{{{MESSAGES}, "vendor": {{"deep": ["{SURROGATE}"]}}}}', "vendor.deep.[0]"),
    ("/v1/chat/completions", f'{{{MESSAGES}, "vendor": {{"{SURROGATE}": 1}}}}', "vendor"),
    ("/v1/chat/completions", f'{{{MESSAGES}, "{SURROGATE}": 1}}', None),
    ("/v1/completions", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/v1/completions", '{"prompt": ["a\\udbff"]}', "prompt.[0]"),
    ("/v1/completions", f'{{"prompt": "hi", "suffix": "{SURROGATE}"}}', "suffix"),
]


@pytest.mark.fast
@pytest.mark.anyio
async def test_a_lone_surrogate_anywhere_is_400_naming_the_param_with_one_audit_record(tmp_path):
    engine, path = FakeEngine(), tmp_path / "audit.jsonl"
    with AuditLog(path) as audit:
        async with asgi(engine, audit) as c:
            for endpoint, body, param in SURROGATE_CASES:
                err = assert_error(await post_raw(c, endpoint, body), 400, "invalid_request_error", param)
                assert "not valid Unicode" in err["message"]
            # a valid pair is one character, and fine
            ok = await post_raw(c, "/v1/completions", '{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
            assert ok.status_code == 200
    records = read_log(path)
    assert [(r.tenant, r.status) for r in records] == [("alice", 400)] * len(SURROGATE_CASES) + [("alice", 200)]
    assert [r.model for r in records[:-1]] == [MODEL] * len(SURROGATE_CASES)  # never the invalid string
    assert len(engine.requests) == 1


# -- the body's size and deadline -----------------------------------------------------------------------------------


def http_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
            "headers": [(b"authorization", b"Bearer sk-alice"), (b"content-type", b"application/json"), *headers],
            "client": ("127.0.0.1", 1), "server": ("test", 80)}


async def call_app(app, scope: dict, receive) -> tuple[int, dict, dict]:
    """Run ``app`` on one request; (status, headers, JSON body) of its response."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 10)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(body)


@pytest.mark.fast
@pytest.mark.anyio
async def test_content_length_over_the_limit_is_413_before_a_byte_is_read(tmp_path):
    path, pulled = tmp_path / "audit.jsonl", []

    async def receive() -> dict:
        pulled.append(1)
        return {"type": "http.request", "body": b"x" * 65536, "more_body": True}

    with AuditLog(path) as audit:
        app = create_app(FakeEngine(), FakeTokenizer(), tenants(), audit, EdgeLimits(max_request_bytes=1000))
        scope = http_scope("/v1/chat/completions", [(b"content-length", b"50000000")])
        status, headers, body = await call_app(app, scope, receive)
    assert (status, body["error"]["code"], body["error"]["type"]) == (413, "request_too_large", "invalid_request_error")
    assert headers["connection"] == "close" and pulled == []
    [record] = read_log(path)
    assert (record.tenant, record.status, record.error_code) == ("alice", 413, "request_too_large")


@pytest.mark.fast
@pytest.mark.anyio
async def test_a_chunked_body_is_cut_as_soon_as_it_passes_the_limit():
    pulled = 0

    async def receive() -> dict:  # an endless chunked body
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * 65536, "more_body": True}

    app = create_app(FakeEngine(), FakeTokenizer(), tenants(), limits=EdgeLimits(max_request_bytes=1_000_000))
    status, _, body = await call_app(app, http_scope("/v1/completions", []), receive)
    assert status == 413 and "1000000 bytes" in body["error"]["message"]
    assert pulled == 1_000_000 // 65536 + 1  # never more than the limit and one chunk


@pytest.mark.fast
@pytest.mark.anyio
async def test_a_body_slower_than_the_body_timeout_is_408_and_recorded(tmp_path):
    path = tmp_path / "audit.jsonl"
    first = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}]

    async def receive() -> dict:
        if first:
            return first.pop()
        await asyncio.sleep(3600)  # the rest never comes
        return {}

    with AuditLog(path) as audit:
        app = create_app(FakeEngine(), FakeTokenizer(), tenants(), audit, EdgeLimits(body_timeout=0.3))
        started = time.monotonic()
        status, headers, body = await call_app(app, http_scope("/v1/completions", []), receive)
    assert 0.3 <= time.monotonic() - started < 2
    assert (status, body["error"]["code"], headers["connection"]) == (408, "request_timeout", "close")
    [record] = read_log(path)
    assert (record.tenant, record.status) == ("alice", 408)


@pytest.mark.fast
def test_the_default_limit_fits_a_max_context_prompt_in_every_json_form():
    context = 8192
    limit = default_max_request_bytes(context)
    ids = json.dumps({"prompt": [49151] * context, "max_tokens": 1})  # the widest token ids
    escaped = json.dumps({"messages": [{"role": "user", "content": "\u4e2d" * context * 2}]})  # \\uXXXX, 2 a token
    assert len(escaped) < len(ids) * 3 < limit
    assert limit == 2 * 2**20  # 2 MiB at 8,192 tokens, as --help says


@pytest.mark.fast
@pytest.mark.anyio
async def test_admin_bodies_are_capped_and_parsed_strictly_too():
    async with asgi(FakeEngine(), limits=EdgeLimits(max_request_bytes=100)) as c:
        big = await c.post(f"/admin/models/{MODEL}/private", content=b"{" + b" " * 200 + b"}", headers=ADMIN | JSON)
        assert_error(big, 413, "invalid_request_error", code="request_too_large")
        bad = await c.post(f"/admin/models/{MODEL}/private", content=b'{"tenants": ["\\ud800"]}', headers=ADMIN | JSON)
        assert_error(bad, 400, "invalid_request_error", "tenants.[0]")
        ok = await c.post(f"/admin/models/{MODEL}/private", json={"tenants": ["alice"]}, headers=ADMIN)
        assert ok.json()["tenants"] == ["alice"]


# -- paths ----------------------------------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/chat%2Fcompletions", "/v1/chat%2fcompletions", "/v1%2Fchat%2Fcompletions",
                                  "/v1/chat%5Ccompletions", "/v1/chat/completions/", "//v1/chat/completions",
                                  "/v1/chat/completions%2F", "/v1/chat%252Fcompletions",
                                  "/v1/x/%2E%2E/chat/completions"])
async def test_no_path_aliases_and_no_redirects(path):
    engine = FakeEngine()
    async with asgi(engine) as c:
        resp = await c.post(path, json=chat_body(), headers=ALICE)
    err = assert_error(resp, 404, "invalid_request_error")
    assert err["message"].startswith("Invalid URL (POST /")
    assert engine.requests == []


@pytest.mark.fast
@pytest.mark.anyio
async def test_escaped_separators_stay_inside_a_path_parameter():
    async with asgi(FakeEngine()) as c:
        for path in ("/health/", "/v1/models/", "/metrics/", "/admin/workers/"):
            assert (await c.get(path, headers=ALICE)).status_code == 404  # never a redirect
        err = assert_error(await c.get("/v1/models/fake%2Fmodel", headers=ALICE), 404, "invalid_request_error",
                           "model", "model_not_found")
        assert "`fake/model`" in err["message"]  # decoded once, as the client meant it
        assert (await c.get(f"/v1/models/{MODEL}", headers=ALICE)).status_code == 200
        assert (await c.get("/v1/models/fake-%6Dodel", headers=ALICE)).status_code == 200  # an escaped letter


@pytest.mark.fast
@pytest.mark.anyio
async def test_api_docs_are_off_unless_asked_for():
    async with asgi(FakeEngine()) as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            assert_error(await c.get(path), 404, "invalid_request_error")
    async with asgi(FakeEngine(), limits=EdgeLimits(docs=True)) as c:
        assert (await c.get("/docs")).status_code == 200
        schema = (await c.get("/openapi.json")).json()
    assert {"/v1/chat/completions", "/v1/completions", "/admin/workers"} <= set(schema["paths"])
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert chat["properties"]["messages"]["items"]["$ref"] == "#/components/schemas/ChatMessage"
    assert "ChatMessage" in schema["components"]["schemas"] and "CompletionRequest" in schema["components"]["schemas"]


# -- least exposure -------------------------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.anyio
async def test_health_says_only_ready_or_not_without_an_admin_key():
    engine = FakeEngine()
    engine.health = lambda: {"mode": "disaggregated", "workers": {"tcp://10.0.0.7:5551": {"pid": 4242}}}
    async with asgi(engine) as c:
        for headers in ({}, ALICE, {"Authorization": "Basic x"}):
            resp = await c.get("/health", headers=headers)
            assert (resp.status_code, resp.json()) == (200, {"status": "ok"})
        assert_error(await c.get("/health", headers={"Authorization": "Bearer sk-guess"}), 401,
                     "authentication_error", code="invalid_api_key")
        detail = (await c.get("/health", headers=ADMIN)).json()
        assert detail["workers"]["tcp://10.0.0.7:5551"]["pid"] == 4242 and detail["safety_layers_off"] == []
        engine.health = lambda: {"status": "waiting for workers", "workers": {}}
        resp = await c.get("/health")
        assert (resp.status_code, resp.json()) == (503, {"status": "unavailable"})
        assert (await c.get("/health", headers=ADMIN)).json()["status"] == "waiting for workers"
    async with asgi(engine, keys=Tenants.open()) as c:  # open mode: no admin key, so nobody sees the detail
        for headers in ({}, ALICE, ADMIN):
            resp = await c.get("/health", headers=headers)
            assert (resp.status_code, resp.json()) == (503, {"status": "unavailable"})


@pytest.mark.fast
def test_redact_removes_every_internal_address():
    for text in ("worker tcp://127.0.0.1:5551 died", "from tcp://[::1]:5551, to ipc:///tmp/kv.sock",
                 "connect to 10.0.0.5:7000 refused", "peer [fe80::1]:99 gone", "host 192.168.1.20 down"):
        out = redact(text)
        assert "<internal address>" in out
        for leaked in ("tcp://", "ipc://", "127.0.0.1", "10.0.0.5", "::1", "fe80", "192.168"):
            assert leaked not in out
    plain = "maximum context length is 4096 tokens; 12:30 ok"
    assert redact(plain) == plain


@pytest.mark.fast
@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_error_bodies_never_name_internal_addresses(stream):
    outputs = [RequestOutput(1, [], "", error=ServiceUnavailable("no word from tcp://10.1.2.3:5551 for 120s"))]
    async with asgi(FakeEngine(outputs=outputs)) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(stream=stream), headers=ALICE)
    assert resp.status_code == 503 and "10.1.2.3" not in resp.text and "tcp://" not in resp.text
    engine = FakeEngine(fail=ServiceUnavailable("decode worker unreachable: tcp://10.1.2.3:5552"), fail_at=1)
    async with asgi(engine) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(stream=True), headers=ALICE)
    assert resp.status_code == 200 and '"error"' in resp.text and "10.1.2.3" not in resp.text


@pytest.mark.fast
def test_the_router_core_names_no_worker_address_in_a_client_error():
    core = RouterCore("tcp://127.0.0.1:5550", 512, Safety(), silence_timeout=1)
    for worker, role in (("tcp://127.0.0.1:5551", "prefill"), ("tcp://127.0.0.1:5552", "decode")):
        core.worker_up(hello(worker, role))
    core.submit(Request([1, 2, 3], SamplingParams(4), rid=1))
    core.submit(Request([1, 2, 3], SamplingParams(4), rid=2))
    errors = [a.error for a in core.worker_down("tcp://127.0.0.1:5552") if getattr(a, "error", None)]
    core.worker_up(hello("tcp://127.0.0.1:5552", "decode"))
    core.submit(Request([1, 2, 3], SamplingParams(4), rid=3))
    core.tick(0.0)
    errors += [a.error for a in core.tick(5.0) if getattr(a, "error", None)]
    assert len(errors) == 3
    assert all("tcp://" not in e.message and "127.0.0.1" not in e.message for e in errors), errors
    assert "decode worker" in errors[0].message and "no word" in errors[2].message


@pytest.mark.fast
def test_failed_logins_are_logged_at_most_once_per_address_and_interval(caplog):
    now = [0.0]
    metrics = Metrics(FakeEngine())
    failures = FailedLogins(metrics.auth_failures, every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvfence.auth"):
        for _ in range(5):
            failures.record("10.0.0.9", "unknown_key", "/v1/models")
        failures.record("10.0.0.8", "missing_key", "/metrics")
        now[0] = 61.0
        failures.record("10.0.0.9", "wrong_key_kind", "/admin/workers")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvfence.auth"]
    assert lines == ["refused a key from 10.0.0.9 on /v1/models: unknown_key",
                     "refused a key from 10.0.0.8 on /metrics: missing_key",
                     "refused a key from 10.0.0.9 on /admin/workers: wrong_key_kind; 4 more refused since the "
                     "previous line"]
    text = metrics.render().decode()
    assert 'kvfence_auth_failures_total{reason="unknown_key"} 5.0' in text


@pytest.mark.fast
@pytest.mark.anyio
async def test_every_refused_key_is_counted_and_logged_without_key_material(caplog):
    async with asgi(FakeEngine()) as c:
        with caplog.at_level(logging.WARNING, logger="kvfence.auth"):
            await c.post("/v1/chat/completions", json=chat_body())
            await c.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sk-secret-guess"})
            await c.get("/v1/models", headers=ADMIN)
            await c.get("/admin/workers", headers=BOB)
            await c.get("/metrics", headers=BOB)
        text = (await c.get("/metrics", headers=ADMIN)).text
    assert 'kvfence_auth_failures_total{reason="missing_key"} 1.0' in text
    assert 'kvfence_auth_failures_total{reason="unknown_key"} 1.0' in text
    assert 'kvfence_auth_failures_total{reason="wrong_key_kind"} 3.0' in text
    lines = [r.getMessage() for r in caplog.records if r.name == "kvfence.auth"]
    assert len(lines) == 1 and "missing_key" in lines[0]  # one line per address and minute
    assert "sk-" not in caplog.text and "sk-" not in text


# -- fair tokenization ----------------------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.anyio
async def test_fair_pool_serves_tenants_round_robin_one_job_each_at_a_time():
    pool, order, gate = FairPool(max_pending_cost=10**9, threads=1), [], threading.Event()

    def job(name: str) -> str:
        if name == "a1":
            gate.wait(5)
        order.append(name)
        return name

    tasks = [asyncio.create_task(pool.run(t, 1, lambda n=n: job(n))) for t, n in
             (("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("b", "b2"))]
    await async_wait_until(lambda: [pool.pending(t) for t in "abc"] == [3, 2, 1], what="every job queued")
    gate.set()
    assert await asyncio.gather(*tasks) == ["a1", "a2", "a3", "b1", "c1", "b2"]
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3"]


@pytest.mark.fast
@pytest.mark.anyio
async def test_fair_pool_bounds_pending_work_per_tenant_and_withdraws_cancelled_jobs():
    pool, gate = FairPool(max_pending_cost=100_000, threads=1), threading.Event()
    first = asyncio.create_task(pool.run("a", 60_000, lambda: gate.wait(5)))
    waiting = asyncio.create_task(pool.run("a", 20_000, lambda: "ran"))
    await async_wait_until(lambda: pool.pending("a") == 2, what="a's two jobs pending")
    with pytest.raises(TooManyRequests) as refused:
        await pool.run("a", 30_000, lambda: None)  # 60k + 20k + 30k > 100k
    answer = _error_response(refused.value)
    assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
    assert json.loads(answer.body)["error"]["code"] == "rate_limit_exceeded"
    other = asyncio.create_task(pool.run("b", 10**9, lambda: "b ok"))  # nothing pending: always admitted
    waiting.cancel()
    await async_wait_until(lambda: pool.pending("a") == 1, what="the cancelled job withdrawn")
    gate.set()
    assert await first and await other == "b ok"
    assert pool.pending("a") == pool.pending("b") == 0


class SlowTokenizer(FakeTokenizer):
    """Encoding takes 1 ms per 100 bytes (time.sleep holds a thread, as a real tokenizer does)."""

    def encode(self, text: str) -> list[int]:
        time.sleep(len(text) / 100_000)
        return super().encode(text)[:8]


@pytest.mark.slow
def test_one_tenants_burst_of_large_requests_does_not_delay_another_tenant(monkeypatch):
    """Alice sends 4 requests that each take 1 s to tokenize; Bob's small one, sent after them, is answered
    about at once: alice holds one of the 2 threads at most (one shared thread, first come first served, made him
    wait 4 s; one thread served round-robin would still make him wait for the rest of alice's job)."""
    submitted: Counter[str] = Counter()

    class SeenPool(FairPool):  # counts the jobs each tenant has handed to the app's pool
        async def run(self, tenant, cost, fn):
            submitted[tenant] += 1
            return await super().run(tenant, cost, fn)

    monkeypatch.setattr(app_module, "FairPool", SeenPool)
    engine = FakeEngine(max_context=4096)
    with serving(engine, tenants(), tokenizer=SlowTokenizer()) as url:
        async def run() -> float:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                big = {"prompt": "x" * 100_000, "max_tokens": 2}
                burst = [asyncio.create_task(c.post("/v1/completions", json=big, headers=ALICE)) for _ in range(4)]
                await async_wait_until(lambda: submitted["alice"] == 4, what="alice's 4 jobs in the pool")
                started = time.monotonic()
                small = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=BOB)
                bob_waited = time.monotonic() - started
                assert small.status_code == 200
                assert [r.status_code for r in await asyncio.gather(*burst)] == [200] * 4
                return bob_waited

        bob_waited = asyncio.run(run())
    assert bob_waited < 0.5, f"bob waited {bob_waited:.2f}s behind alice's burst"


# -- the connection: real uvicorn behind EdgeProtocol, raw sockets --------------------------------------------------


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def head(path: str, length: int | None = None, key: str = "sk-alice", extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"{size}{extra}\r\n").encode()


EDGE = EdgeLimits(header_timeout=0.5, body_timeout=0.5, max_connections_per_client=4)


@contextlib.contextmanager
def edge_server(engine: FakeEngine | None = None, limits: EdgeLimits = EDGE, audit: AuditLog | None = None
                ) -> Iterator[str]:
    with serving(engine or FakeEngine(), tenants(), limits, audit=audit) as url:
        yield url


@pytest.mark.fast
@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"])
def test_headers_that_never_finish_get_408_and_the_connection_closes(sent):
    with edge_server() as url, connect(url) as sock:
        started = time.monotonic()
        sock.sendall(sent)
        status, headers, body = read_response(sock)
        assert (status, json.loads(body)["error"]["code"]) == (408, "request_timeout")
        assert closed_by_server(sock, 2)
        assert 0.4 < time.monotonic() - started < 2.5


@pytest.mark.fast
def test_a_stalled_body_gets_408_and_its_audit_record(tmp_path):
    path = tmp_path / "audit.jsonl"
    with AuditLog(path) as audit, edge_server(audit=audit) as url, connect(url) as sock:
        started = time.monotonic()
        sock.sendall(head("/v1/completions", 1000) + b'{"prompt": ')  # 10 bytes of 1,000
        status, headers, _ = read_response(sock)
        assert (status, headers["connection"]) == (408, "close")
        assert closed_by_server(sock, 2) and time.monotonic() - started < 2.5
    [record] = read_log(path)
    assert (record.tenant, record.status, record.error_code) == ("alice", 408, "request_timeout")


@pytest.mark.slow
def test_an_unread_body_that_trickles_on_is_cut_too():
    """A 401 is answered without reading the body; a client trickling the rest is still cut off."""
    with edge_server() as url, connect(url) as sock:
        sock.sendall(head("/v1/completions", 1000, key="sk-wrong") + b"{")
        status, _, _ = read_response(sock)
        assert status == 401
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(30):
                sock.sendall(b" ")
                time.sleep(0.1)  # the behaviour under test: a client that trickles a byte every 100 ms
        assert closed_by_server(sock, 3) and time.monotonic() - started < 3.5


@pytest.mark.slow
def test_streams_and_keep_alive_are_not_cut_by_the_read_timeouts():
    class SlowEngine(FakeEngine):
        async def generate(self, request):
            async for out in super().generate(request):
                await asyncio.sleep(0.25)  # the behaviour under test: a stream slower than the read timeouts
                yield out

    engine = SlowEngine(pieces=tuple("abcdef"))
    with edge_server(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-alice", max_retries=0, timeout=10)
        started = time.monotonic()
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "abcdef"
        assert time.monotonic() - started > 1.4  # three times the timeouts
        with connect(url) as sock:  # one connection, two requests 1 s apart (keep-alive is uvicorn's 5 s)
            body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
            for _ in range(2):
                sock.sendall(head("/v1/completions", len(body)) + body)
                assert read_response(sock)[0] == 200
                time.sleep(1)  # the behaviour under test: an idle keep-alive connection outlives the read timeouts


@pytest.mark.fast
def test_connections_per_client_address_are_bounded():
    limits = EdgeLimits(header_timeout=30, max_connections_per_client=3)
    with edge_server(limits=limits) as url:
        held = [connect(url) for _ in range(3)]
        wait_until(lambda: open_connections(url) == 3, 5, "the server to count the 3 connections")
        with connect(url) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            status, _, body = read_response(extra)
            assert (status, json.loads(body)["error"]["code"]) == (429, "too_many_connections")
            assert closed_by_server(extra, 3)
        held.pop().close()
        wait_until(lambda: open_connections(url) == 2, 5, "the server to see one close")
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        for sock in held:
            sock.close()


def start_50_mb_upload(sock: socket.socket, path: str, chunked: bool) -> threading.Thread:
    """Send the headers of a 50 MB body (declared, or chunked), then the body from a thread, as fast as loopback
    goes; the thread stops quietly once the server closes."""
    sock.sendall(head(path, None if chunked else 50_000_000))
    chunk = b"x" * 1_000_000
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n" if chunked else chunk

    def upload() -> None:
        with contextlib.suppress(OSError):
            for _ in range(50):
                sock.sendall(frame)

    uploader = threading.Thread(target=upload, daemon=True)
    uploader.start()
    return uploader


@pytest.mark.fast
@pytest.mark.parametrize("chunked", [False, True])
def test_a_50_mb_body_gets_413_at_once_and_the_client_reads_it(chunked):
    limits = EdgeLimits(max_request_bytes=1_000_000)
    with edge_server(limits=limits) as url, connect(url) as sock:
        started = time.monotonic()
        uploader = start_50_mb_upload(sock, "/v1/completions", chunked)
        status, headers, body = read_response(sock)
        took = time.monotonic() - started
        assert (status, json.loads(body)["error"]["code"], headers["connection"]) == (413, "request_too_large",
                                                                                        "close")
        assert took < 1, f"413 after {took:.2f}s"
        uploader.join(10)
        assert closed_by_server(sock, 5)


@pytest.mark.fast
@pytest.mark.parametrize("request_bytes", [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 20_000])
def test_unparsable_requests_and_huge_headers_get_400_in_openai_shape(request_bytes):
    with edge_server() as url, connect(url) as sock:
        sock.sendall(request_bytes)
        status, headers, body = read_response(sock)
        assert (status, json.loads(body)["error"]["code"]) == (400, "invalid_http_request")
        assert closed_by_server(sock, 2)


@pytest.mark.fast
def test_raw_dot_segments_are_not_normalized_into_a_route():
    engine = FakeEngine()
    with edge_server(engine) as url:
        for path in ("/v1/./chat/completions", "/v1/x/../chat/completions", "/v1//chat/completions"):
            with connect(url) as sock:
                body = json.dumps(chat_body()).encode()
                sock.sendall(head(path, len(body)) + body)
                assert read_response(sock)[0] == 404
    assert engine.requests == []


@pytest.mark.fast
def test_upgrade_requests_are_plain_http_and_keep_the_connection_count(caplog):
    limits = EdgeLimits(max_connections_per_client=2)
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to the root
    with edge_server(limits=limits) as url:
        uvicorn_log.addHandler(caplog.handler)
        for _ in range(5):
            with connect(url) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                             b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
                assert read_response(sock)[0] == 200
        wait_until(lambda: open_connections(url) == 0, 5, "every upgrade connection to leave the count")  # none lost
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        uvicorn_log.removeHandler(caplog.handler)
    assert caplog.text.count("unsupported upgrade request") == 1  # once per address and minute
