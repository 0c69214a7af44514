"""The admin API: admin keys, private models, drained workers; the router core's drained set; one real server.

Most tests drive the app in process (httpx over ASGI) with the scripted ``FakeEngine`` of ``test_http`` standing
in for a colocated engine, or a ``RemoteEngine`` whose workers are Hello messages fed to its core. The last test
runs a real disaggregated ``kvfence serve`` on a tiny model and talks to it with the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from urllib.parse import quote

import httpx
import openai
import pytest

from kvfence.auditlog import AuditLog, read_records
from kvfence.core import Request, SamplingParams
from kvfence.protocol.actions import Deliver, Send
from kvfence.protocol.messages import Hello, Output
from kvfence.protocol.router import RouterCore
from kvfence.router.app import create_app
from kvfence.router.remote import RemoteEngine
from kvfence.router.settings import RouterSettings
from kvfence.router.tenants import TenantConfigError, Tenants
from kvfence.safety import Safety
from kvfence.workers.supervisor import free_tcp_address
from tests.server import Server
from tests.sides import side
from tests.test_http import KEYS, MODEL, FakeEngine, FakeTokenizer, assert_error, chat_body
from tests.tiny_models import tiny_model_dir

ADMIN_KEY = "sk-admin-1"
ADMIN_NAME = "admin-" + hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:8]
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


def tenants() -> Tenants:
    return Tenants(KEYS, admin_keys=[ADMIN_KEY])


@contextlib.asynccontextmanager
async def asgi(engine, tenants: Tenants, audit: AuditLog | None = None):
    app = create_app(engine, FakeTokenizer(), tenants, audit)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client


# -- admin keys ------------------------------------------------------------------------------


@pytest.mark.fast
def test_admin_section_is_loaded_and_its_keys_kept_only_as_digests(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.alice]\napi_keys = ["sk-alice"]\n\n[admin]\napi_keys = ["{ADMIN_KEY}", "sk-admin-2"]\n')
    t = Tenants.from_toml(path)
    assert t.names == ("alice",)
    assert t.authenticate_admin(f"Bearer {ADMIN_KEY}") == ADMIN_NAME
    assert t.authenticate_admin("Bearer sk-admin-2").startswith("admin-")
    assert ADMIN_KEY not in repr(vars(t))


@pytest.mark.fast
@pytest.mark.parametrize("admin, match", [
    ("api_keys = []", "non-empty list"),
    ('api_keys = ["a b"]', r"api_keys\[0\]"),
    ('api_keys = ["sk-x"]\nextra = 1', "only api_keys"),
    ('api_keys = ["sk-alice"]', "already a key of tenant 'alice'"),
    ('api_keys = ["sk-x", "sk-x"]', r"already a key of \[admin\]"),
])
def test_malformed_admin_section_fails_at_load_without_printing_keys(tmp_path, admin, match):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.alice]\napi_keys = ["sk-alice"]\n\n[admin]\n{admin}\n')
    with pytest.raises(TenantConfigError, match=match) as e:
        Tenants.from_toml(path)
    assert "sk-alice" not in str(e.value) and "sk-x" not in str(e.value)


@pytest.mark.fast
@pytest.mark.anyio
async def test_admin_api_needs_an_admin_key_and_admin_keys_cannot_generate():
    engine = FakeEngine()
    async with asgi(engine, tenants()) as c:
        assert_error(await c.get("/admin/workers"), 401, "authentication_error", code="invalid_api_key")
        assert_error(await c.get("/admin/workers", headers={"Authorization": "Bearer sk-nope"}), 401,
                     "authentication_error", code="invalid_api_key")
        assert_error(await c.post("/admin/models/x/private", headers=ALICE), 403, "permission_error",
                     code="permission_denied")
        assert_error(await c.post("/v1/chat/completions", json=chat_body(), headers=ADMIN), 403, "permission_error",
                     code="permission_denied")
        assert_error(await c.get("/v1/models", headers=ADMIN), 403, "permission_error", code="permission_denied")
        assert (await c.get("/admin/workers", headers=ADMIN)).status_code == 200
    async with asgi(engine, Tenants(KEYS)) as c:  # no [admin] section: the admin API is off
        err = assert_error(await c.get("/admin/models", headers=BOB), 403, "permission_error",
                           code="permission_denied")
        assert "tenant" in err["message"]
        err = assert_error(await c.get("/admin/models", headers=ADMIN), 401, "authentication_error",
                           code="invalid_api_key")
        assert "[admin]" in err["message"]
    assert engine.requests == []


# -- private models ------------------------------------------------------------------------------


async def assert_model_unknown(c: httpx.AsyncClient, headers: dict) -> None:
    """Every way to reach the model answers as for a model that does not exist."""
    assert (await c.get("/v1/models", headers=headers)).json()["data"] == []
    unknown = assert_error(await c.get("/v1/models/no-such-model", headers=headers), 404, "invalid_request_error",
                           "model", "model_not_found")
    err = assert_error(await c.get(f"/v1/models/{MODEL}", headers=headers), 404, "invalid_request_error", "model",
                       "model_not_found")
    assert err["message"] == unknown["message"].replace("no-such-model", MODEL)
    assert_error(await c.post("/v1/chat/completions", json=chat_body(), headers=headers), 404,
                 "invalid_request_error", "model", "model_not_found")
    body = chat_body()
    del body["model"]  # an omitted model means the served one: still not theirs
    assert_error(await c.post("/v1/chat/completions", json=body, headers=headers), 404, "invalid_request_error",
                 "model", "model_not_found")
    assert_error(await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers), 404,
                 "invalid_request_error", "model", "model_not_found")


@pytest.mark.fast
@pytest.mark.anyio
async def test_private_model_is_an_unknown_model_to_tenants_not_allowed(caplog):
    engine = FakeEngine()
    async with asgi(engine, tenants()) as c:
        with caplog.at_level(logging.INFO, logger="kvfence.admin"):
            resp = await c.post(f"/admin/models/{MODEL}/private", json={"tenants": ["alice"]}, headers=ADMIN)
        assert resp.json() == {"id": MODEL, "private": True, "tenants": ["alice"]}
        assert f"admin {ADMIN_NAME} made model {MODEL} private (allowed tenants: alice)" in caplog.text
        assert (await c.get("/admin/models", headers=ADMIN)).json()["data"] == [resp.json()]
        await assert_model_unknown(c, BOB)
        assert engine.requests == []
        assert [m["id"] for m in (await c.get("/v1/models", headers=ALICE)).json()["data"]] == [MODEL]
        assert (await c.post("/v1/chat/completions", json=chat_body(), headers=ALICE)).status_code == 200

        resp = await c.post(f"/admin/models/{MODEL}/public", headers=ADMIN)
        assert resp.json() == {"id": MODEL, "private": False, "tenants": None}
        assert (await c.post("/v1/chat/completions", json=chat_body(), headers=BOB)).status_code == 200
        assert (await c.get(f"/v1/models/{MODEL}", headers=BOB)).status_code == 200
    assert [r.tenant for r in engine.requests] == ["alice", "bob"]


@pytest.mark.fast
@pytest.mark.anyio
async def test_private_without_a_body_hides_the_model_from_every_tenant():
    async with asgi(FakeEngine(), tenants()) as c:
        assert (await c.post(f"/admin/models/{MODEL}/private", headers=ADMIN)).json()["tenants"] == []
        await assert_model_unknown(c, ALICE)
        await assert_model_unknown(c, BOB)


@pytest.mark.fast
@pytest.mark.anyio
async def test_private_needs_a_known_model_and_known_tenants():
    async with asgi(FakeEngine(), tenants()) as c:
        assert_error(await c.post("/admin/models/other/private", headers=ADMIN), 404, "invalid_request_error",
                     "model", "model_not_found")
        assert_error(await c.post("/admin/models/other/public", headers=ADMIN), 404, "invalid_request_error",
                     "model", "model_not_found")
        err = assert_error(await c.post(f"/admin/models/{MODEL}/private", json={"tenants": ["alice", "carol"]},
                                        headers=ADMIN), 400, "invalid_request_error", "tenants")
        assert "carol" in err["message"]
        assert_error(await c.post(f"/admin/models/{MODEL}/private", json={"tenants": "alice"}, headers=ADMIN), 400,
                     "invalid_request_error", "tenants")
        assert (await c.get("/admin/models", headers=ADMIN)).json()["data"][0]["private"] is False


# -- public prefixes -----------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.anyio
async def test_a_published_prefix_marks_the_requests_that_start_with_it_and_only_while_published(caplog):
    engine = FakeEngine()
    system = {"role": "system", "content": "Be brief."}
    async with asgi(engine, tenants()) as c:
        with caplog.at_level(logging.INFO, logger="kvfence.admin"):
            resp = await c.post("/admin/prefixes", json={"model": MODEL, "messages": [system]}, headers=ADMIN)
        prefix = resp.json()
        assert resp.status_code == 200 and prefix["tokens"] == len("<system>Be brief.")
        assert prefix["published_by"] == ADMIN_NAME and f"admin {ADMIN_NAME} published prefix" in caplog.text
        again = await c.post("/admin/prefixes", json={"prompt": list(b"<system>Be brief.")}, headers=ADMIN)
        assert again.json()["id"] == prefix["id"]  # the same tokens: the same prefix
        assert (await c.get("/admin/prefixes", headers=ADMIN)).json()["data"] == [prefix]

        for headers in (ALICE, BOB):
            body = {"model": MODEL, "messages": [system, {"role": "user", "content": "hi"}]}
            assert (await c.post("/v1/chat/completions", json=body, headers=headers)).status_code == 200
        assert (await c.post("/v1/chat/completions", json=chat_body(), headers=ALICE)).status_code == 200
        resp = await c.delete(f"/admin/prefixes/{prefix['id']}", headers=ADMIN)
        assert resp.json() == {"id": prefix["id"], "object": "prefix", "deleted": True}
        body = {"model": MODEL, "messages": [system, {"role": "user", "content": "hi"}]}
        assert (await c.post("/v1/chat/completions", json=body, headers=ALICE)).status_code == 200
        assert (await c.get("/admin/prefixes", headers=ADMIN)).json()["data"] == []
    assert [(r.tenant, r.public_tokens) for r in engine.requests] == [
        ("alice", prefix["tokens"]), ("bob", prefix["tokens"]), ("alice", 0), ("alice", 0)]


@pytest.mark.fast
@pytest.mark.anyio
async def test_only_an_admin_publishes_a_prefix_and_a_bad_one_is_refused():
    async with asgi(FakeEngine(), tenants()) as c:
        assert_error(await c.post("/admin/prefixes", json={"prompt": "x"}, headers=ALICE), 403, "permission_error",
                     code="permission_denied")
        assert_error(await c.delete("/admin/prefixes/prefix-1", headers=BOB), 403, "permission_error",
                     code="permission_denied")
        assert_error(await c.post("/admin/prefixes", json={"prompt": "x"}), 401, "authentication_error",
                     code="invalid_api_key")
        for body, param in [({}, "prompt"), ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                                             "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [300]}, "prompt"),
                            ({"prompt": "x" * 64}, "prompt"), ({"prompt": "x", "tenant": "bob"}, "tenant")]:
            assert_error(await c.post("/admin/prefixes", json=body, headers=ADMIN), 400, "invalid_request_error",
                         param)
        assert_error(await c.post("/admin/prefixes", json={"model": "other", "prompt": "x"}, headers=ADMIN), 404,
                     "invalid_request_error", "model", "model_not_found")
        assert_error(await c.delete("/admin/prefixes/prefix-1", headers=ADMIN), 404, "invalid_request_error",
                     "prefix_id", "prefix_not_found")
        assert (await c.get("/admin/prefixes", headers=ADMIN)).json()["data"] == []


# -- draining: colocated -------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.anyio
async def test_draining_the_colocated_engine_makes_new_requests_503_until_undrained(caplog):
    engine = FakeEngine()
    async with asgi(engine, tenants()) as c:
        table = (await c.get("/admin/workers", headers=ADMIN)).json()["data"]
        assert table == [{"index": 0, "id": "local", "role": "colocated", "drained": False}]
        with caplog.at_level(logging.INFO, logger="kvfence.admin"):
            resp = await c.post("/admin/workers/0/drain", headers=ADMIN)
        assert resp.json() == {"index": 0, "id": "local", "role": "colocated", "drained": True}
        assert f"admin {ADMIN_NAME} drained worker local" in caplog.text
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(), headers=ALICE), 503,
                           "service_unavailable")
        assert "drained" in err["message"]
        resp = await c.post("/v1/chat/completions", json=chat_body(stream=True), headers=ALICE)
        assert resp.status_code == 503  # a stream too: its status is settled before the first event
        assert engine.requests == []
        assert (await c.post("/admin/workers/local/undrain", headers=ADMIN)).json()["drained"] is False
        assert (await c.post("/v1/chat/completions", json=chat_body(), headers=ALICE)).status_code == 200
        for ref in ("1", "nope", quote("tcp://127.0.0.1:1", safe="")):
            assert_error(await c.post(f"/admin/workers/{ref}/drain", headers=ADMIN), 404, "invalid_request_error",
                         "worker", "worker_not_found")


class GatedEngine(FakeEngine):
    """Yields its first output, then waits for ``gate`` before the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def generate(self, request):
        async for out in super().generate(request):
            yield out
            if not out.finished and not self.gate.is_set():
                self.waiting.set()
                await self.gate.wait()


@pytest.mark.fast
@pytest.mark.anyio
async def test_a_request_in_flight_on_a_drained_engine_finishes_normally():
    engine = GatedEngine()
    async with asgi(engine, tenants()) as c:
        in_flight = asyncio.create_task(c.post("/v1/chat/completions", json=chat_body(), headers=ALICE))
        await asyncio.wait_for(engine.waiting.wait(), 10)
        assert (await c.post("/admin/workers/local/drain", headers=ADMIN)).status_code == 200
        engine.gate.set()
        resp = await asyncio.wait_for(in_flight, 10)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "Hello world"


# -- draining: the router core (sans-IO) ------------------------------------------------------------


def hello(worker: str, role: str, free: int = 10) -> Hello:
    return Hello(worker, worker, side(role), 1000, 64, free_pages=free)


def core_with(*workers: tuple[str, str]) -> RouterCore:
    core = RouterCore("router", max_context=64, safety=Safety())
    for worker, role in workers:
        core.worker_up(hello(worker, role))
    return core


def request(rid: int = 1) -> Request:
    return Request([1, 2, 3], SamplingParams(2), "alice", rid=rid)


def sent_to(actions) -> tuple[str, ...]:
    return tuple(a.to for a in actions if isinstance(a, Send))


@pytest.mark.fast
def test_core_never_picks_a_drained_worker():
    core = core_with(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
    core.drained |= {"d0", "p0"}
    for rid in range(1, 5):
        assert sent_to(core.submit(request(rid))) == ("d1", "p1")
    core.drained.clear()
    assert sent_to(core.submit(request(9))) == ("d0", "p0")  # undrained: the least loaded again


@pytest.mark.fast
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_core_with_every_worker_of_a_role_drained_answers_503(role):
    core = core_with(("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    core.drained |= {w for w, i in core.workers.items() if i.hello.role == role}
    [out] = core.submit(request())
    assert isinstance(out, Deliver) and out.error.status == 503
    assert f"Every {role} worker is drained" in out.error.message
    assert core.reqs == {}


@pytest.mark.fast
def test_core_drained_worker_finishes_its_requests_in_flight():
    core = core_with(("p0", "prefill"), ("d0", "decode"))
    core.submit(request())
    core.drained.add("d0")
    out = Output(1, [5], "x", "stop", completion_tokens=1)
    assert core.handle("d0", out) == [Deliver(1, output=out)]
    assert core.reqs == {}


@pytest.mark.fast
def test_core_drain_outlives_a_restart_of_the_worker():
    core = core_with(("p0", "prefill"), ("d0", "decode"))
    core.drained.add("d0")
    core.worker_down("d0")
    core.worker_up(hello("d0", "decode"))
    assert core.submit(request())[0].error.status == 503


# -- draining: disaggregated, through the admin API ---------------------------------------------------


@contextlib.contextmanager
def remote_engine():
    """A RemoteEngine whose workers are Hello messages fed to its core (nothing listens at their addresses)."""
    engine = RemoteEngine(RouterSettings(free_tcp_address(), MODEL, 64))
    for worker, role in (("tcp://127.0.0.1:1001", "decode"), ("tcp://127.0.0.1:1002", "prefill")):
        engine.core.worker_up(hello(worker, role))
    try:
        yield engine
    finally:
        for task in engine._tasks:
            task.cancel()
        engine.channel.close()


@pytest.mark.fast
@pytest.mark.anyio
async def test_disaggregated_workers_are_drained_by_url_encoded_id_or_index():
    decode = "tcp://127.0.0.1:1001"
    with remote_engine() as engine:
        async with asgi(engine, tenants()) as c:
            table = (await c.get("/admin/workers", headers=ADMIN)).json()["data"]
            assert [(e["index"], e["id"], e["role"], e["drained"]) for e in table] == [
                (0, decode, "decode", False), (1, "tcp://127.0.0.1:1002", "prefill", False)]
            resp = await c.post(f"/admin/workers/{quote(decode, safe='')}/drain", headers=ADMIN)
            assert resp.status_code == 200 and resp.json()["drained"] is True
            assert engine.core.drained == {decode}
            err = assert_error(await c.post("/v1/chat/completions", json=chat_body(), headers=ALICE), 503,
                               "service_unavailable")
            assert "Every decode worker is drained" in err["message"]
            engine.worker_died(decode)  # gone but drained: still listed, so it can be undrained
            gone = (await c.get("/admin/workers", headers=ADMIN)).json()["data"][0]
            assert gone == {"index": 0, "id": decode, "role": None, "drained": True, "live": False}
            assert (await c.post("/admin/workers/0/undrain", headers=ADMIN)).json()["drained"] is False
            assert engine.core.drained == set()
            assert (await c.get("/admin/workers", headers=ADMIN)).json()["data"][0]["id"] != decode


@pytest.mark.fast
@pytest.mark.anyio
async def test_remote_engine_remembers_each_request_route_after_it_ended():
    with remote_engine() as engine:
        outputs = engine.generate(request(7))
        first = asyncio.create_task(anext(outputs))
        while 7 not in engine.core.reqs:
            await asyncio.sleep(0)
        engine.executor.receive("tcp://127.0.0.1:1001", Output(7, [5], "x", "stop", completion_tokens=1))
        assert (await first).finished
        await outputs.aclose()
        assert engine.route(7) == ("tcp://127.0.0.1:1002", "tcp://127.0.0.1:1001", 0)
        assert engine.route(8) is None


# -- end to end: a real disaggregated server, the openai client -----------------------------------


def completion(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt="Hello there", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


@pytest.mark.slow
def test_admin_metrics_and_audit_log_on_a_real_server(tmp_path):
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text('[tenants.alice]\napi_keys = ["sk-alice"]\n\n[tenants.bob]\napi_keys = ["sk-bob"]\n\n'
                            f'[admin]\napi_keys = ["{ADMIN_KEY}"]\n')
    audit = tmp_path / "audit.jsonl"
    with Server("--model", str(tiny_model_dir("llama")), "--max-context", "512", "--kv-pool-tokens", "2048",
                "--tenants", str(tenants_file), "--audit-log", str(audit)) as server:
        admin = httpx.Client(base_url=server.url + "/admin", headers=ADMIN, timeout=10)
        alice, bob = server.client("sk-alice"), server.client("sk-bob")
        model = alice.models.list().data[0].id

        assert admin.post(f"/models/{model}/private", json={"tenants": ["alice"]}).status_code == 200
        with pytest.raises(openai.NotFoundError) as e:
            completion(bob, model)
        assert e.value.code == "model_not_found"
        assert [m.id for m in bob.models.list()] == []
        completion(alice, model)
        assert admin.post(f"/models/{model}/public").status_code == 200
        completion(bob, model)

        workers = admin.get("/workers").json()["data"]
        [decode] = [w for w in workers if w["role"] == "decode"]
        assert admin.post(f"/workers/{quote(decode['id'], safe='')}/drain").json()["drained"] is True
        with pytest.raises(openai.APIStatusError) as e:
            completion(bob, model)
        assert e.value.status_code == 503
        assert admin.post(f"/workers/{decode['index']}/undrain").json()["drained"] is False
        completion(bob, model)

        metrics = httpx.get(server.url + "/metrics", headers=ADMIN, timeout=10).text
    for line in ('kvfence_requests_total{status="200",tenant="bob"} 2.0',
                 'kvfence_requests_total{status="404",tenant="bob"} 1.0',
                 'kvfence_requests_total{status="503",tenant="bob"} 1.0',
                 'kvfence_requests_total{status="200",tenant="alice"} 1.0',
                 'kvfence_output_tokens_total{tenant="bob"} 8.0',
                 'kvfence_time_to_first_token_seconds_count{tenant="bob"} 2.0',
                 'kvfence_time_to_first_token_seconds_count{tenant="alice"} 1.0',
                 'kvfence_rejections_total{layer="none",reason="model_not_found"} 1.0',
                 f'kvfence_kv_pages_total{{role="decode",worker="{decode["id"]}"}}'):
        assert line in metrics, line
    assert "sk-" not in metrics

    records = list(read_records(audit.read_bytes().splitlines(), problems := []))
    assert problems == []
    assert [(r.tenant, r.status, r.admission) for r in records] == [
        ("bob", 404, "rejected"), ("alice", 200, "accepted"), ("bob", 200, "accepted"), ("bob", 503, "rejected"),
        ("bob", 200, "accepted")]
    ok = records[-1]
    assert (ok.prefill, ok.decode, ok.verification, ok.output_tokens) == (
        next(w["id"] for w in workers if w["role"] == "prefill"), decode["id"], "ok", 4)
    assert ok.pages and ok.finish_reason == "length" and ok.error is None
    assert records[3].error_code == "service_unavailable" and records[3].decode is None
