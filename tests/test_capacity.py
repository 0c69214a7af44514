"""Capacity isolation at the router: the per-tenant queue, its fair order, quotas and 429s, 503 only when no worker
can serve. Exact actions out of the sans-IO ``RouterCore`` and ``FairQueue``; the colocated front
(``QueuedEngine``) over a scripted engine; the 429's HTTP shape; the tenants file's quotas.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvfence.core import Request, SamplingParams, ServiceUnavailable, TooManyRequests
from kvfence.protocol.actions import Deliver, Send
from kvfence.protocol.capacity import DispatchLimits, FairQueue, QueuePolicy, TenantQuota
from kvfence.protocol.messages import Admit, Hello, Output, Params, Prefill
from kvfence.protocol.router import RouterCore, retry_rid
from kvfence.router.queued import QueuedEngine
from kvfence.router.tenants import TenantConfigError, Tenants
from kvfence.safety import Safety
from tests.server import async_wait_until
from tests.sides import side, target
from tests.test_http import KEYS, FakeEngine, chat_body, make_app

pytestmark = pytest.mark.fast


R, P, D = "router", "prefill-0", "decode-0"


def req(rid: int, tenant: str = "alice", n: int = 16, max_tokens: int = 16) -> Request:
    return Request(list(range(1, n + 1)), SamplingParams(max_tokens), tenant, rid=rid)


def sent(actions) -> list[tuple[str, int]]:
    """(worker, rid) of each Admit and Prefill sent, in order."""
    return [(a.to, a.msg.rid) for a in actions if isinstance(a, Send) and isinstance(a.msg, Admit | Prefill)]


def started(actions) -> list[int]:
    """The rids of the requests sent to a pair."""
    return [a.msg.rid for a in actions if isinstance(a, Send) and isinstance(a.msg, Admit)]


def delivered_errors(actions) -> dict[int, int]:
    return {a.rid: a.error.status for a in actions if isinstance(a, Deliver) and a.error is not None}


def core(pages: int = 8, backlog: int | None = 1024, policy: QueuePolicy | None = None, grace: float = 30.0,
         silence: float = 120.0) -> RouterCore:
    """One prefill and one decode worker; decode has ``pages`` pages of 16 tokens."""
    c = RouterCore(R, max_context=4096, safety=Safety(), silence_timeout=silence, policy=policy,
                   limits=DispatchLimits(prefill_backlog_tokens=backlog, output_reserve_tokens=512, worker_grace=grace))
    c.worker_up(Hello(P, "tcp://p", side("prefill"), 4096, 4096))
    c.worker_up(decode_hello(pages))
    return c


def decode_hello(pages: int, pid: int = 0) -> Hello:
    return Hello(D, "tcp://d", side("decode"), pages * 16, 4096, free_pages=pages, total_pages=pages, pid=pid)


def finish(rid: int, tokens: int = 1) -> Output:
    return Output(rid, [7] * tokens, "x", "stop", completion_tokens=tokens)


# -- the queue instead of 503 ----------------------------------------------------------------------------


def test_a_request_without_room_waits_and_goes_once_a_request_ends():
    """Each request reserves its prompt plus its max_tokens (2 pages of 16 tokens): 4 pages hold two."""
    c = core(pages=4)
    assert started(c.submit(req(1))) == [1] and started(c.submit(req(2))) == [2]
    assert c.submit(req(3)) == [] and c.queued() == 1
    out = c.handle(D, finish(1))
    assert out[0] == Deliver(1, output=finish(1))
    assert sent(out[1:]) == [(D, 3), (P, 3)] and c.queued() == 0
    assert out[1].msg == Admit(3, "alice", list(range(1, 17)), Params(16), P)


def test_a_decode_worker_holding_nothing_always_takes_one_request():
    c = core(pages=1)  # smaller than the request's reservation, but the prompt fits the pool
    assert started(c.submit(req(1, n=8, max_tokens=8))) == [1]
    assert c.submit(req(2, n=8, max_tokens=8)) == []


def test_a_prefill_worker_gets_another_prompt_only_while_its_backlog_is_under_the_bound():
    """The bound counts prompt tokens whose handoff has not ended; a first token ends it."""
    c = core(pages=100, backlog=20)
    assert started(c.submit(req(1))) == [1]  # backlog 0 -> 16
    assert started(c.submit(req(2))) == [2]  # 16 < 20 -> 32
    assert c.submit(req(3)) == []
    first = Output(1, [5], "a", completion_tokens=1)
    out = c.handle(D, first)
    assert out[0] == Deliver(1, output=first) and started(out) == [3]  # backlog 16 again
    assert c.handle(D, Output(1, [6], "b", completion_tokens=2)) == [Deliver(1, output=Output(1, [6], "b",
                                                                                              completion_tokens=2))]


def test_a_client_that_leaves_while_queued_is_simply_removed():
    c = core(pages=2)
    c.submit(req(1))
    assert c.submit(req(2)) == [] and c.queued() == 1
    assert c.client_gone(2) == [] and c.queued() == 0
    assert started(c.handle(D, finish(1))) == []  # nothing left to send
    assert c.client_gone(2) == []


def test_queue_time_does_not_count_toward_the_silence_timeout():
    c = core(pages=2, silence=10.0)
    c.submit(req(1), now=0)
    c.submit(req(2), now=0)  # waits behind 1
    for t in (0.0, 5.0):
        assert c.tick(t) == []
    c.handle(D, Output(1, [5], "a", completion_tokens=1))
    for t in (10.0, 14.0):
        assert c.tick(t) == []
    assert started(c.handle(D, Output(1, [6], "b", "stop", completion_tokens=2))) == [2]  # after 14 s of waiting
    assert c.tick(16.0) == [] and c.tick(25.0) == []  # 2's silence counts from here
    out = c.tick(26.5)
    assert delivered_errors(out) == {2: 503} and out[-1].error.code == "worker_silent"


# -- 503 only when no worker can serve ------------------------------------------------------------------------


def test_no_503_while_a_worker_restarts_within_the_grace():
    c = core(grace=30.0)
    c.submit(req(1), now=0)
    out = c.worker_down(D)
    assert delivered_errors(out) == {} and c.queued() == 1  # it had no token yet: it waits for its retry
    assert c.submit(req(2), now=1) == [] and c.queued() == 2
    assert c.tick(2.0) == [] and c.tick(30.0) == []
    out = c.worker_up(decode_hello(8, pid=2))
    assert started(out) == [retry_rid(1), 2] and delivered_errors(out) == {}


def test_requests_waiting_for_a_missing_role_get_503_after_the_grace():
    c = core(grace=30.0)
    c.worker_down(P)
    c.submit(req(1), now=10)
    assert c.tick(10.0) == [] and c.tick(40.0) == []
    out = c.tick(40.5)
    assert delivered_errors(out) == {1: 503} and out[0].error.code == "no_workers" and c.queued() == 0
    [refused] = c.submit(req(2), now=41)
    assert refused.error.status == 503 and "No prefill worker" in refused.error.message


def test_draining_every_worker_of_a_role_fails_the_queue_with_503_and_undraining_sends_at_once():
    c = core(pages=2)
    c.submit(req(1))
    c.submit(req(2))
    out = c.set_drained(D, True)
    assert delivered_errors(out) == {2: 503} and "drained" in out[0].error.message
    assert c.set_drained(D, False) == []
    assert c.submit(req(3)) == []  # 1 still holds the pages
    assert started(c.handle(D, finish(1))) == [3]


def test_a_request_larger_than_every_pool_in_rotation_is_503_and_never_blocks_the_queue():
    c = core(pages=8)
    c.worker_up(Hello("decode-big", "tcp://b", target("big"), 4096, 4096, free_pages=256, total_pages=256))
    c.set_drained("decode-big", True)
    [out] = c.submit(req(1, n=200, max_tokens=100))
    assert isinstance(out.error, ServiceUnavailable)
    assert started(c.submit(req(2))) == [2]


# -- fair order ----------------------------------------------------------------------------------------------


def test_a_newcomer_goes_before_a_tenant_that_was_already_served():
    """bob floods; alice's one request, sent after four of bob's are waiting, leaves the queue first."""
    c = core(pages=2)
    c.submit(req(1, "bob"))
    for rid in (2, 3, 4, 5):
        assert c.submit(req(rid, "bob")) == []
    assert c.submit(req(10, "alice")) == []
    assert started(c.handle(D, finish(1))) == [10]
    assert started(c.handle(D, finish(10))) == [2]


def test_first_come_first_served_keeps_arrival_order():
    c = core(pages=2, policy=QueuePolicy(scheduling="fcfs"))
    c.submit(req(1, "bob"))
    for rid, tenant in ((2, "bob"), (3, "bob"), (10, "alice")):
        c.submit(req(rid, tenant))
    assert [started(c.handle(D, finish(rid)))[0] for rid in (1, 2, 3)] == [2, 3, 10]


def start_order(queue: FairQueue, n: int, completion: dict[str, int] | None = None) -> list[str]:
    """The tenants of the next ``n`` requests to start, each ending at once after ``completion[tenant]`` tokens."""
    order = []
    for _ in range(n):
        entry = queue.next()
        queue.start(entry)
        tenant = entry.req.tenant
        queue.charge(tenant, (completion or {}).get(tenant, 0))
        queue.ended(tenant)
        order.append(tenant)
    return order


def backlogged(policy: QueuePolicy, tenants: tuple[str, ...], each: int = 8, n: int = 16) -> FairQueue:
    q = FairQueue(policy)
    rid = 0
    for _ in range(each):
        for t in tenants:
            rid += 1
            assert q.add(req(rid, t, n=n), now=0) is None
    return q


def test_weights_share_starts_in_proportion():
    quotas = {"c": TenantQuota(weight=2)}
    q = backlogged(QueuePolicy(quotas), ("a", "b", "c"))
    order = start_order(q, 12)
    assert order == ["a", "b", "c", "c", "a", "b", "c", "c", "a", "b", "c", "c"]


def test_a_started_request_takes_its_tenants_weight_to_the_workers():
    q = FairQueue(QueuePolicy({"c": TenantQuota(weight=2.5)}))
    for tenant in ("a", "c"):
        assert q.add(Request([1, 2], SamplingParams(4), tenant), now=0) is None
    started = []
    while (entry := q.next()) is not None:
        q.start(entry)
        started.append((entry.req.tenant, entry.req.weight))
    assert sorted(started) == [("a", 1.0), ("c", 2.5)]


def test_completion_tokens_count_toward_the_share():
    """a's requests each produce 48 tokens, b's none: per token served, b starts 4 requests for each of a's."""
    q = backlogged(QueuePolicy(), ("a", "b"))
    order = start_order(q, 10, completion={"a": 48})
    assert order.count("b") == 4 * order.count("a") and order[:2] == ["a", "b"]


def test_an_idle_tenant_banks_no_credit():
    q = backlogged(QueuePolicy(), ("a",), each=6)
    start_order(q, 5)  # a alone: 5 x 16 tokens served
    assert q.add(req(100, "b"), now=0) is None
    assert q.add(req(101, "b"), now=0) is None
    assert start_order(q, 3) == ["b", "a", "b"]  # b starts level with a, not 80 tokens behind


def test_max_concurrent_requests_holds_the_rest_in_the_queue():
    c = core(pages=100, policy=QueuePolicy({"bob": TenantQuota(max_concurrent_requests=2)}))
    assert started(c.submit(req(1, "bob")) + c.submit(req(2, "bob"))) == [1, 2]
    assert c.submit(req(3, "bob")) == []
    assert started(c.submit(req(4, "alice"))) == [4]  # others are not held up
    assert started(c.handle(D, finish(2))) == [3]


# -- quotas and 429s -------------------------------------------------------------------------------------------


def test_a_full_tenant_queue_answers_429_with_retry_after():
    c = core(pages=2, policy=QueuePolicy({"bob": TenantQuota(max_queued=2)}))
    c.submit(req(1, "bob"))
    assert c.submit(req(2, "bob")) == [] and c.submit(req(3, "bob")) == []
    [out] = c.submit(req(4, "bob"))
    err = out.error
    assert isinstance(err, TooManyRequests) and out.rid == 4
    assert (err.status, err.type, err.code, err.reason) == (429, "requests", "rate_limit_exceeded", "tenant_queue_full")
    assert err.headers == {"Retry-After": "1"}
    assert c.submit(req(5, "alice")) == []  # alice's queue is her own


def test_a_full_server_queue_still_takes_tenants_under_an_equal_share():
    q = FairQueue(QueuePolicy(max_queued_requests=4))
    for rid in range(4):
        assert q.add(req(rid, "bob"), now=0) is None
    err = q.add(req(9, "bob"), now=0)
    assert err.reason == "server_queue_full" and err.headers["Retry-After"] == "1"
    assert q.add(req(10, "alice"), now=0) is None and q.add(req(11, "alice"), now=0) is None  # under 4 / 2
    assert q.add(req(12, "alice"), now=0).reason == "server_queue_full"
    for rid in range(20, 30):
        q.add(req(rid, f"t{rid}"), now=0)
    assert len(q) == 8  # never more than twice the bound


def test_tokens_per_minute_answers_429_saying_when_it_fits_again():
    """Prompt tokens are taken on admission, completion tokens as they are delivered."""
    c = core(pages=100, policy=QueuePolicy({"alice": TenantQuota(tokens_per_minute=120)}))
    assert started(c.submit(req(1, n=40), now=0)) == [1]
    c.handle(D, Output(1, [5] * 20, "x", "stop", completion_tokens=20))  # 120 - 40 - 20 = 60 left
    assert started(c.submit(req(2, n=40), now=0)) == [2]  # 20 left
    [out] = c.submit(req(3, n=50), now=0)
    err = out.error
    assert (err.status, err.type, err.code, err.reason) == (429, "tokens", "rate_limit_exceeded", "tokens_per_minute")
    assert err.headers == {"Retry-After": "15"}  # 30 more tokens at 2 a second
    assert "limit 120" in err.message and "requested 50" in err.message
    assert c.submit(req(3, n=50), now=14)[0].error.headers == {"Retry-After": "1"}
    assert started(c.submit(req(3, n=50), now=15)) == [3]


def test_a_full_bucket_admits_a_prompt_longer_than_a_minutes_budget():
    q = FairQueue(QueuePolicy({"alice": TenantQuota(tokens_per_minute=10)}))
    assert q.add(req(1, n=30), now=0) is None
    assert q.add(req(2, n=5), now=0).headers == {"Retry-After": "150"}  # 20 in debt, then 5 more, at 1 per 6 s
    q.withdraw(1)  # it left before starting: its tokens come back
    assert q.add(req(2, n=5), now=0) is None


# -- colocated: the same queue in front of one engine ---------------------------------------------------------


class PagedFakeEngine(FakeEngine):
    """A FakeEngine with a 4-page pool of 16 tokens that holds every request until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def generate(self, request: Request):
        self.requests.append(request)
        yield self._script(request)[0]
        await self.release.wait()
        for out in self._script(request)[1:]:
            yield out

    def health(self) -> dict:
        return {"mode": "fake", "kv_pages_total": 4, "kv_pool_tokens": 64, "kv_pages_free": 4}


@pytest.mark.anyio
async def test_colocated_requests_wait_for_room_leave_the_queue_when_cancelled_and_say_their_queue_time():
    engine = PagedFakeEngine()
    queued = QueuedEngine(engine, QueuePolicy({"bob": TenantQuota(max_queued=1)}))
    streams = []  # held, so that none is closed (which would end its request)

    async def first_output(rid: int, tenant: str):
        streams.append(queued.generate(req(rid, tenant)))
        return await anext(streams[-1])

    one, _ = await first_output(1, "bob"), await first_output(2, "bob")  # 2 pages each: the pool is full
    assert one.queue_time is not None and [r.rid for r in engine.requests] == [1, 2]
    waiting = asyncio.create_task(first_output(3, "bob"))
    await async_wait_until(lambda: queued.health()["queued"] == 1, what="bob's third request queued")
    assert queued.health()["queued_by_tenant"] == {"bob": 1}
    with pytest.raises(TooManyRequests):
        await first_output(4, "bob")
    leaving = asyncio.create_task(first_output(5, "alice"))
    await async_wait_until(lambda: queued.health()["queued"] == 2, what="alice's request queued")
    leaving.cancel()
    await async_wait_until(lambda: queued.health()["queued"] == 1, what="alice's cancelled request gone")  # bob's waits
    engine.release.set()
    async for _ in streams[0]:  # 1 ends: its pages are free for 3
        pass
    assert (await asyncio.wait_for(waiting, 1)).rid == 3
    assert [r.rid for r in engine.requests] == [1, 2, 3]


class PrefillingFakeEngine(PagedFakeEngine):
    """A PagedFakeEngine whose first outputs come only once ``prefilled`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.prefilled = asyncio.Event()

    async def generate(self, request: Request):
        self.requests.append(request)
        await self.prefilled.wait()
        yield self._script(request)[0]
        await self.release.wait()
        for out in self._script(request)[1:]:
            yield out

    def health(self) -> dict:
        return {"mode": "fake"}  # no pool figures: only the backlog bounds


@pytest.mark.anyio
async def test_colocated_the_next_prompt_starts_when_the_backlog_gets_a_first_token_not_when_a_request_ends():
    """With room for one prompt of backlog, request 2 waits while 1 is prefilled, and starts as soon as 1 has its
    first token, while 1 still decodes (a prompt's backlog ends with its first token, as in disaggregated mode)."""
    engine = PrefillingFakeEngine()
    queued = QueuedEngine(engine, limits=DispatchLimits(prefill_backlog_tokens=1, output_reserve_tokens=None))
    first, second = queued.generate(req(1, "alice")), queued.generate(req(2, "alice"))
    one, two = asyncio.create_task(anext(first)), asyncio.create_task(anext(second))
    await async_wait_until(lambda: queued.health()["queued"] == 1, what="request 2 queued behind 1's prefill")
    assert [r.rid for r in engine.requests] == [1]
    engine.prefilled.set()
    assert (await asyncio.wait_for(one, 1)).rid == 1
    assert (await asyncio.wait_for(two, 1)).rid == 2  # 1 has not ended: release is not set
    engine.release.set()
    for stream in (first, second):
        async for _ in stream:
            pass


@pytest.mark.anyio
async def test_a_429_leaves_in_openais_shape_with_retry_after_and_is_counted_by_reason():
    tenants = Tenants(KEYS, admin_keys=["sk-admin"], quotas={"bob": TenantQuota(tokens_per_minute=30)})
    engine = QueuedEngine(FakeEngine(), QueuePolicy(tenants.quotas))
    app = make_app(engine, tenants)
    bob, admin = {"Authorization": "Bearer sk-bob"}, {"Authorization": "Bearer sk-admin"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        assert (await c.post("/v1/chat/completions", json=chat_body("x" * 20), headers=bob)).status_code == 200
        for stream in (False, True):
            resp = await c.post("/v1/chat/completions", json=chat_body("x" * 20, stream=stream), headers=bob)
            assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1
            err = resp.json()["error"]
            assert (err["type"], err["code"]) == ("tokens", "rate_limit_exceeded")
        metrics = (await c.get("/metrics", headers=admin)).text
    assert 'kvfence_rate_limited_total{reason="tokens_per_minute",tenant="bob"} 2.0' in metrics
    assert 'kvfence_queue_length{tenant="alice"} 0.0' in metrics
    assert 'kvfence_queue_time_seconds_count{tenant="bob"} 1.0' in metrics
    assert 'kvfence_time_to_first_token_seconds_count{tenant="bob"} 1.0' in metrics


# -- the tenants file --------------------------------------------------------------------------------------------


def load(tmp_path, text: str) -> Tenants:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return Tenants.from_toml(path)


def test_tenants_file_quotas_and_defaults(tmp_path):
    t = load(tmp_path, '[tenants.alice]\napi_keys = ["sk-a"]\n\n[tenants.bob]\napi_keys = ["sk-b"]\nweight = 2\n'
                       'max_concurrent_requests = 4\nmax_queued = 16\ntokens_per_minute = 100000\n')
    assert t.quotas == {"bob": TenantQuota(2.0, 4, 16, 100000)}
    assert QueuePolicy(t.quotas).quota("alice") == TenantQuota(1.0, None, None, None)


@pytest.mark.parametrize("line, match", [
    ("weight = 0", "weight must be a number above 0"),
    ("weight = -1.5", "weight must be a number above 0"),
    ("weight = nan", "weight must be a number above 0"),
    ("weight = inf", "weight must be a number above 0"),
    ('weight = "2"', "weight must be a number above 0"),
    ("weight = true", "weight must be a number above 0"),
    ("max_concurrent_requests = 0", "max_concurrent_requests must be a whole number of at least 1, not 0"),
    ("max_queued = 2.5", "max_queued must be a whole number"),
    ("max_queued = -1", "max_queued must be a whole number"),
    ("tokens_per_minute = false", "tokens_per_minute must be a whole number"),
    ('tokens_per_minute = "1k"', "tokens_per_minute must be a whole number"),
    ("max_tokens_per_minute = 5", r"unknown keys \['max_tokens_per_minute'\]"),
])
def test_tenants_file_quota_mistakes_fail_at_load_naming_the_tenant(tmp_path, line, match):
    with pytest.raises(TenantConfigError, match=match) as e:
        load(tmp_path, f'[tenants.bob]\napi_keys = ["sk-b"]\n{line}\n')
    assert "tenant 'bob'" in str(e.value) and "sk-b" not in str(e.value)
