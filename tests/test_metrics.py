"""GET /metrics (Prometheus text) and the audit log: one ledger entry per request, whatever its end.

In process (httpx over ASGI, or the ASGI app called directly for a client that leaves) with the scripted
``FakeEngine`` of ``test_http``; the real-server check is in ``test_admin``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfence.auditlog import AuditLog, AuditRecord, read_records
from kvfence.core import FinishReason, IntegrityError, RequestOutput
from kvfence.protocol.messages import Output
from kvfence.router.app import create_app
from kvfence.router.metrics import Metrics
from kvfence.router.tenants import Tenants
from tests.test_admin import ADMIN, ADMIN_KEY, ALICE, BOB, core_with, request, tenants
from tests.test_http import KEYS, MODEL, FakeEngine, FakeTokenizer, assert_error, chat_body, template


@contextlib.asynccontextmanager
async def asgi(engine, audit: AuditLog | None = None):
    app = create_app(engine, FakeTokenizer(), tenants(), audit)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, from Prometheus text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, frozenset(labels.items())))


async def scrape(c: httpx.AsyncClient) -> str:
    resp = await c.get("/metrics", headers=ADMIN)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return resp.text


# -- metrics ---------------------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.anyio
async def test_requests_tokens_and_latencies_are_counted_by_tenant_and_status():
    async with asgi(FakeEngine()) as c:
        assert value(await scrape(c), "kvfence_time_to_first_token_seconds_count", tenant="alice") is None
        await c.post("/v1/chat/completions", json=chat_body(), headers=ALICE)
        await c.post("/v1/chat/completions", json=chat_body(stream=True), headers=ALICE)
        await c.post("/v1/chat/completions", json=chat_body("x" * 100), headers=BOB)
        await c.post("/v1/chat/completions", json=chat_body(model="other"), headers=BOB)
        await c.post("/v1/chat/completions", json=chat_body())  # no key: no tenant, not counted
        text = await scrape(c)
    assert value(text, "kvfence_requests_total", tenant="alice", status="200") == 2
    assert value(text, "kvfence_requests_total", tenant="bob", status="400") == 1
    assert value(text, "kvfence_requests_total", tenant="bob", status="404") == 1
    assert sum(v for (name, _), v in samples(text).items() if name == "kvfence_requests_total") == 4
    assert value(text, "kvfence_output_tokens_total", tenant="alice") == 6
    assert value(text, "kvfence_rejections_total", layer="admission", reason="context_length_exceeded") == 1
    assert value(text, "kvfence_rejections_total", layer="none", reason="model_not_found") == 1
    # one per request with tokens, by tenant
    assert value(text, "kvfence_time_to_first_token_seconds_count", tenant="alice") == 2
    assert value(text, "kvfence_time_per_output_token_seconds_count") == 4  # the 2 later tokens of each
    assert "sk-alice" not in text and "sk-bob" not in text and ADMIN_KEY not in text


@pytest.mark.fast
@pytest.mark.anyio
@pytest.mark.parametrize("layer", ["tags", "coverage", "checksum"])
async def test_kv_verification_failures_are_counted_by_layer(layer):
    engine = FakeEngine(fail=IntegrityError("KV cache verification failed.", layer=layer))
    async with asgi(engine) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body(), headers=ALICE)).status_code == 500
        text = await scrape(c)
    assert value(text, "kvfence_kv_verification_failures_total", layer=layer) == 1
    assert value(text, "kvfence_rejections_total", layer=layer, reason="kv_integrity") == 1
    assert value(text, "kvfence_requests_total", tenant="alice", status="500") == 1


@pytest.mark.fast
def test_tokens_arriving_together_share_their_interval():
    metrics = Metrics(FakeEngine())
    metrics.later_tokens(0.3, 3)
    text = metrics.render().decode()
    assert value(text, "kvfence_time_per_output_token_seconds_count") == 3
    assert value(text, "kvfence_time_per_output_token_seconds_sum") == pytest.approx(0.3)


@pytest.mark.fast
@pytest.mark.anyio
async def test_pool_gauges_come_from_colocated_health():
    engine = FakeEngine()
    engine.health = lambda: {"mode": "colocated", "kv_pages_total": 100, "kv_pages_free": 60}
    async with asgi(engine) as c:
        text = await scrape(c)
    labels = {"worker": "local", "role": "colocated"}
    assert value(text, "kvfence_kv_pages_total", **labels) == 100
    assert value(text, "kvfence_kv_pages_in_use", **labels) == 40
    assert value(text, "kvfence_kv_pages_quarantined", **labels) == 0
    assert value(text, "kvfence_kv_transfers_in_flight") == 0


@pytest.mark.fast
@pytest.mark.anyio
async def test_pool_gauges_and_transfers_come_from_each_workers_heartbeat():
    engine = FakeEngine()
    workers = {"tcp://h:1": {"role": "decode", "total_pages": 64, "free_pages": 50, "quarantined_pages": 4},
               "tcp://h:2": {"role": "prefill", "total_pages": 32, "free_pages": 32, "quarantined_pages": 0}}
    engine.health = lambda: {"mode": "disaggregated", "transfers_in_flight": 3, "workers": workers}
    async with asgi(engine) as c:
        text = await scrape(c)
    decode = {"worker": "tcp://h:1", "role": "decode"}
    assert value(text, "kvfence_kv_pages_total", **decode) == 64
    assert value(text, "kvfence_kv_pages_in_use", **decode) == 10
    assert value(text, "kvfence_kv_pages_quarantined", **decode) == 4
    assert value(text, "kvfence_kv_pages_in_use", worker="tcp://h:2", role="prefill") == 0
    assert value(text, "kvfence_kv_transfers_in_flight") == 3


@pytest.mark.fast
@pytest.mark.anyio
async def test_prefix_cache_pages_and_evictions_come_from_colocated_health_and_prefill_heartbeats():
    engine = FakeEngine()
    workers = {"tcp://h:1": {"role": "decode", "total_pages": 64, "free_pages": 64, "quarantined_pages": 0},
               "tcp://h:2": {"role": "prefill", "total_pages": 32, "free_pages": 32, "quarantined_pages": 0,
                             "cached_pages": 7, "cache_evictions": 3}}
    engine.health = lambda: {"mode": "disaggregated", "workers": workers}
    async with asgi(engine) as c:
        text = await scrape(c)
    prefill = {"worker": "tcp://h:2", "role": "prefill"}
    assert value(text, "kvfence:prefix_cache_pages", **prefill) == 7
    assert value(text, "kvfence:prefix_cache_evictions_total", **prefill) == 3
    assert "tcp://h:1" not in "".join(line for line in text.splitlines() if "prefix_cache" in line)
    engine.health = lambda: {"mode": "colocated", "kv_pages_total": 10, "kv_pages_free": 10, "cached_pages": 4,
                             "cache_evictions": 0}
    async with asgi(engine) as c:
        text = await scrape(c)
    assert value(text, "kvfence:prefix_cache_pages", worker="local", role="colocated") == 4


@pytest.mark.fast
def test_router_core_counts_requests_in_their_handoff():
    core = core_with(("p0", "prefill"), ("d0", "decode"))
    core.submit(request(1))
    core.submit(request(2))
    assert core.in_handoff() == 2
    core.handle("d0", Output(1, [5], "x", completion_tokens=1))  # the first token: its KV has landed
    assert core.in_handoff() == 1


@pytest.mark.fast
@pytest.mark.anyio
async def test_each_app_has_its_own_registry():
    async with asgi(FakeEngine()) as one, asgi(FakeEngine()) as two:
        await one.post("/v1/chat/completions", json=chat_body(), headers=ALICE)
        assert value(await scrape(one), "kvfence_requests_total", tenant="alice", status="200") == 1
        assert value(await scrape(two), "kvfence_requests_total", tenant="alice", status="200") is None


@pytest.mark.fast
@pytest.mark.anyio
async def test_metrics_need_an_admin_or_metrics_key_with_tenants_and_none_without():
    app = create_app(FakeEngine(), FakeTokenizer(), Tenants(KEYS, admin_keys=["sk-admin-1"], metrics_keys=["sk-prom"]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        assert_error(await c.get("/metrics"), 401, "authentication_error", code="invalid_api_key")
        assert_error(await c.get("/metrics", headers={"Authorization": "Bearer sk-nope"}), 401,
                     "authentication_error", code="invalid_api_key")
        assert_error(await c.get("/metrics", headers=ALICE), 403, "permission_error", code="permission_denied")
        assert (await c.get("/metrics", headers=ADMIN)).status_code == 200
        prom = {"Authorization": "Bearer sk-prom"}
        text = (await c.get("/metrics", headers=prom)).text
        for reason, n in (("missing_key", 1), ("unknown_key", 1), ("wrong_key_kind", 1)):
            assert value(text, "kvfence_auth_failures_total", reason=reason) == n
        assert "sk-" not in text
        # a metrics key does nothing else
        assert_error(await c.post("/v1/chat/completions", json=chat_body(), headers=prom), 403, "permission_error",
                     code="permission_denied")
        assert_error(await c.get("/admin/workers", headers=prom), 403, "permission_error", code="permission_denied")
    app = create_app(FakeEngine(), FakeTokenizer(), Tenants.open())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        assert (await c.get("/metrics")).status_code == 200  # open mode: no keys exist, nothing to hold it to


# -- audit log -----------------------------------------------------------------------------------------


def read_log(path) -> list[AuditRecord]:
    problems: list[str] = []
    records = list(read_records(path.read_bytes().splitlines(), problems))
    assert problems == []
    return records


@pytest.mark.fast
@pytest.mark.anyio
async def test_one_audit_record_per_request_whatever_its_end(tmp_path):
    path = tmp_path / "audit.jsonl"
    engine = FakeEngine()
    with AuditLog(path) as audit:
        async with asgi(engine, audit) as c:
            await c.post("/v1/chat/completions", json=chat_body(max_tokens=5), headers=ALICE)
            await c.post("/v1/chat/completions", json=chat_body("x" * 100), headers=BOB)
            await c.post(f"/admin/models/{MODEL}/private", json={"tenants": ["alice"]}, headers=ADMIN)
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=BOB)
            await c.post("/admin/workers/local/drain", headers=ADMIN)
            await c.post("/v1/chat/completions", json=chat_body(stream=True), headers=ALICE)
            await c.post("/v1/chat/completions", json=chat_body())  # no key: not a tenant's request
    ok, too_long, private, drained = read_log(path)
    prompt = len(template(("user", "hi")))
    assert (ok.tenant, ok.rid, ok.model, ok.endpoint, ok.status, ok.admission, ok.decided_by) == (
        "alice", f"{engine.requests[0].rid:032x}", MODEL, "/v1/chat/completions", 200, "accepted", None)
    assert (ok.prompt_tokens, ok.output_tokens, ok.max_tokens, ok.finish_reason) == (prompt, 3, 5, "stop")
    assert (ok.prefill, ok.decode, ok.verification, ok.error, ok.error_code) == (
        "local", "local", "n/a (colocated)", None, None)
    assert ok.duration_s >= 0
    assert (too_long.tenant, too_long.status, too_long.admission, too_long.decided_by, too_long.error_code) == (
        "bob", 400, "rejected", "admission", "context_length_exceeded")
    assert too_long.prompt_tokens == len(template(("user", "x" * 100))) and too_long.prefill is None
    assert "maximum context length" in too_long.error
    assert (private.tenant, private.endpoint, private.status, private.admission, private.error_code) == (
        "bob", "/v1/completions", 404, "rejected", "model_not_found")
    assert (drained.tenant, drained.status, drained.admission, drained.error_code, drained.prefill) == (
        "alice", 503, "rejected", "service_unavailable", None)
    assert len({r.rid for r in (ok, too_long, private, drained)}) == 4


@pytest.mark.fast
@pytest.mark.anyio
async def test_audit_record_carries_pages_verification_and_a_verification_failure(tmp_path):
    path = tmp_path / "audit.jsonl"
    last = RequestOutput(0, [7], "!", FinishReason.LENGTH, pages=[(3, 9), (4, 9)], verification="ok")
    engine = FakeEngine(outputs=[RequestOutput(0, [6], "hi"), last])
    with AuditLog(path) as audit:
        async with asgi(engine, audit) as c:
            await c.post("/v1/chat/completions", json=chat_body(), headers=ALICE)
            engine.outputs, engine.fail = None, IntegrityError("tags: page 3: owner mismatch", layer="tags")
            await c.post("/v1/chat/completions", json=chat_body(), headers=ALICE)
    ok, failed = read_log(path)
    assert (ok.pages, ok.verification, ok.finish_reason, ok.output_tokens) == ([(3, 9), (4, 9)], "ok", "length", 2)
    assert (failed.status, failed.admission, failed.decided_by, failed.error_code) == (
        500, "rejected", "tags", "kv_integrity")
    assert failed.verification == "failed: tags: page 3: owner mismatch" and failed.pages == []


def http_scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-alice")],
            "client": ("127.0.0.1", 1), "server": ("test", 80)}


@pytest.mark.fast
@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_is_recorded_as_499(tmp_path, stream):
    path = tmp_path / "audit.jsonl"
    engine = FakeEngine(block_at=1)
    body = json.dumps(chat_body(stream=stream)).encode()
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        while not engine.blocked.is_set():  # leave once the engine is mid-request
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    with AuditLog(path) as audit:
        app = create_app(engine, FakeTokenizer(), tenants(), audit)
        await asyncio.wait_for(app(http_scope("/v1/chat/completions"), receive, send), 10)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            text = (await client.get("/metrics", headers=ADMIN)).text
    [record] = read_log(path)
    assert (record.tenant, record.status, record.admission, record.error) == ("alice", 499, "accepted", None)
    assert record.output_tokens == 1 and engine.ending == "CancelledError"
    assert value(text, "kvfence_requests_total", tenant="alice", status="499") == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_vllm_named_metrics_count_a_real_request(mode):
    """vLLM's metric names under ``kvfence:``: token counters, phase histograms, running/waiting gauges."""
    from tests.server import Server
    from tests.tiny_models import tiny_model_dir

    with Server("--mode", mode, "--model", str(tiny_model_dir("llama")), "--max-context", "256") as server:
        reply = server.client().completions.create(model="llama", prompt="count", max_tokens=5,
                                                   extra_body={"ignore_eos": True})
        text = httpx.get(server.url + "/metrics", timeout=10).text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kvfence:")}
    assert values['kvfence:prompt_tokens_total{tenant="default"}'] == reply.usage.prompt_tokens
    assert values['kvfence:generation_tokens_total{tenant="default"}'] == 5
    for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                  "time_to_first_token"):
        assert values[f'kvfence:{phase}_seconds_count{{tenant="default"}}'] == 1, phase
    assert values["kvfence:num_requests_running"] == 0 and values["kvfence:num_requests_waiting"] == 0
