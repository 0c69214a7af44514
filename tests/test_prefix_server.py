"""Prefix caching end to end: real ``kvfence serve`` processes (colocated, and 1 prefill + 1 decode worker over
ZeroMQ and shm) on the tiny random-weight Llama, through the official openai client. A repeated prompt reads
its prefix from the cache (``usage.prompt_tokens_details.cached_tokens``) and answers the same; another tenant,
or another ``cache_salt``, recomputes; with ``KVFENCE_UNSAFE=prefix_scope`` the other tenant reads the first
one's pages, which is the timing side channel the layer closes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import TINY
from tests.server import Server

pytestmark = pytest.mark.slow


KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
ADMIN = "sk-admin"
SYSTEM = "You are a careful assistant. " + "Answer every question about the quarterly report briefly. " * 8
PAGE = 16


def serve(mode: str, tenants: Path, unsafe: str = "") -> Server:
    return Server("--mode", mode, *TINY, "--tenants", str(tenants), env={"KVFENCE_UNSAFE": unsafe})


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def server(request, tenants_file):
    with serve(request.param, tenants_file) as s:
        yield s


def ask(server: Server, tenant: str, question: str, **extra) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of a greedy chat with the shared system prompt."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = server.client(KEYS[tenant]).chat.completions.create(
        model="llama", messages=messages, max_tokens=8, temperature=0, extra_body=extra or None)
    return reply.choices[0].message.content, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens


def metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + ("{" + want if want else "")))


def test_a_repeated_prompt_reads_its_prefix_from_the_cache_and_answers_the_same(server):
    first, prompt_tokens, cached = ask(server, "alice", "What is the report about?")
    assert cached == 0 and prompt_tokens > 4 * PAGE
    again = ask(server, "alice", "What is the report about?")
    assert again == (first, prompt_tokens, (prompt_tokens - 2) // PAGE * PAGE)
    other = ask(server, "alice", "Who wrote it?")
    assert 0 < other[2] < prompt_tokens and other[2] % PAGE == 0  # the system prompt's pages
    stream = server.client(KEYS["alice"]).completions.create(
        model="llama", prompt=SYSTEM, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage and usage[0].prompt_tokens_details.cached_tokens % PAGE == 0
    assert metric(server, "kvfence:prefix_cache_hits_total", tenant="alice") >= again[2] + other[2]
    assert metric(server, "kvfence:prefix_cache_queries_total", tenant="alice") >= 3 * prompt_tokens
    deadline = time.monotonic() + 5  # disaggregated: the prefill worker's next heartbeat carries it
    while not metric(server, "kvfence:prefix_cache_pages") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "kvfence:prefix_cache_pages") > 0


def test_another_tenant_or_salt_never_reads_alices_pages(server):
    question = "What does the report cover?"
    alice = ask(server, "alice", question)
    assert ask(server, "alice", question)[2] > 0
    assert ask(server, "bob", question) == (alice[0], alice[1], 0)
    assert ask(server, "alice", question, cache_salt="user-7") == (alice[0], alice[1], 0)
    assert ask(server, "alice", question, cache_salt="user-7")[2] > 0


def test_requests_reading_the_same_cached_pages_at_once_all_pass_verification(server):
    """On prefill, the cached pages of several prompts in flight ship at once, each with its own tag record."""
    question = "Is the report long?"
    alone = ask(server, "alice", question)

    async def together() -> list[str]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        async with server.async_client(KEYS["alice"]) as client:
            replies = await asyncio.gather(*(client.chat.completions.create(
                model="llama", messages=messages, max_tokens=8, temperature=0) for _ in range(4)))
        assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in replies)
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(together()) == [alone[0]] * 4


def test_with_prefix_scope_off_bob_reads_alices_pages(tenants_file):
    """The harm the ``prefix_scope`` layer prevents, on the prefill worker's cache: bob's first request reads the
    pages alice's computed, so a timing probe would see it answer sooner."""
    with serve("disaggregated", tenants_file, unsafe="prefix_scope") as s:
        alice = ask(s, "alice", "Summarize the report.")
        bob = ask(s, "bob", "Summarize the report.")
        assert bob[0] == alice[0] and bob[2] == (alice[1] - 2) // PAGE * PAGE
        assert ask(s, "bob", "Summarize the report.", cache_salt="x")[2] > 0


def test_a_published_system_prompt_is_computed_once_for_every_tenant_and_withdrawn_is_private_again(server):
    """The admin publishes a system prompt: whichever tenant sends it first computes its pages, and every other
    tenant's request reads them (and only them: what follows stays the tenant's own). Withdrawn, it is keyed in
    each tenant's scope again."""
    system = "You are the help desk of the northern region. " * 6
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"})
    prefix = admin.post("/admin/prefixes", json={"messages": [{"role": "system", "content": system}]}).json()
    public = prefix["tokens"] // PAGE * PAGE
    assert public >= 2 * PAGE

    def chat(tenant: str, question: str) -> tuple[str, int, int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        reply = server.client(KEYS[tenant]).chat.completions.create(model="llama", messages=messages, max_tokens=8,
                                                                     temperature=0)
        usage = reply.usage
        return reply.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    question = "Where is the office, and which floor is the help desk on?"
    answer, prompt_tokens, cached = chat("alice", question)
    whole = (prompt_tokens - 2) // PAGE * PAGE
    assert cached == 0 and whole > public
    assert chat("bob", question) == (answer, prompt_tokens, public)  # the public pages, not alice's own
    assert chat("bob", question)[2] == whole  # bob's own pages after them, cached for bob
    assert admin.delete(f"/admin/prefixes/{prefix['id']}").json()["deleted"] is True
    assert chat("bob", "When does it open?")[2] == 0
    assert chat("alice", "When does it open?")[2] == 0
