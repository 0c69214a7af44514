"""The HTTP edge of a real ``kvfence serve`` (router + prefill + decode processes, a tiny model): huge, slow and
malformed requests from one tenant while another is served, and what callers without a key can see.

The router is the ``kvfence serve`` process itself, so its memory is read from ``/proc/<pid>/status``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server import Server, wait_until
from tests.test_edge import closed_by_server, connect, head, read_response, start_50_mb_upload
from tests.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


ADMIN = {"Authorization": "Bearer sk-admin"}
TENANTS = ('[tenants.alice]\napi_keys = ["sk-alice"]\n\n[tenants.bob]\napi_keys = ["sk-bob"]\n\n'
           '[admin]\napi_keys = ["sk-admin"]\n\n[metrics]\napi_keys = ["sk-prom"]\n')


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


@contextlib.contextmanager
def sampled_rss(pid: int):
    """Yield a list that fills with the process's RSS (MiB), sampled every 10 ms until the block ends."""
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(rss_mib(pid))
            time.sleep(0.01)  # the sampling period, not a wait for anything

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join(5)


def upload_50_mb(url: str, chunked: bool) -> tuple[int, dict, float]:
    """Send a 50 MB body (declared, or chunked) as fast as loopback goes; (status, error, seconds to the answer)."""
    with connect(url) as sock:
        started = time.monotonic()
        uploader = start_50_mb_upload(sock, "/v1/chat/completions", chunked)
        status, _, body = read_response(sock)
        took = time.monotonic() - started
        uploader.join(10)
        return status, json.loads(body)["error"], took


def timed_completion(client: openai.OpenAI, model: str) -> float:
    started = time.monotonic()
    client.completions.create(model=model, prompt="Hello there", max_tokens=4, temperature=0)
    return time.monotonic() - started


@pytest.mark.timeout(300)
def test_a_real_server_holds_its_edge_against_one_tenant_while_serving_another(tmp_path):
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text(TENANTS)
    audit = tmp_path / "audit.jsonl"
    with Server("--model", str(tiny_model_dir("llama")), "--max-context", "512", "--kv-pool-tokens", "2048",
                "--tenants", str(tenants_file), "--audit-log", str(audit), "--header-timeout", "2",
                "--body-timeout", "3") as server:
        pid, url = server.proc.pid, server.url
        alice, bob = server.client("sk-alice", timeout=30), server.client("sk-bob", timeout=30)
        model = bob.models.list().data[0].id
        timed_completion(bob, model)  # warm

        # a 50 MB body, declared or chunked: 413 at once, the router's memory flat, bob served meanwhile
        baseline, peak_before = rss_mib(pid), rss_mib(pid, "VmHWM")
        with sampled_rss(pid) as samples:
            for chunked in (False, True):
                status, error, took = upload_50_mb(url, chunked)
                assert (status, error["code"]) == (413, "request_too_large") and took < 1, (chunked, took)
                print(f"50 MB body ({'chunked' if chunked else 'Content-Length'}): 413 after {took * 1000:.0f} ms")
            bob_during = []
            uploads = [threading.Thread(target=upload_50_mb, args=(url, c)) for c in (False, True)]
            for t in uploads:
                t.start()
            bob_during.append(timed_completion(bob, model))
            for t in uploads:
                t.join(30)
        grew = max(samples) - baseline
        assert grew < 20 and rss_mib(pid, "VmHWM") - peak_before < 20, (grew, baseline)
        assert bob_during[0] < 3, bob_during
        print(f"router RSS {baseline:.0f} MiB, at most +{grew:.1f} MiB during four 50 MB uploads; bob answered in "
              f"{bob_during[0]:.2f}s during two of them")

        # slow clients: headers that never end, a body that stalls; bob is served, they are cut off
        stalled = [connect(url) for _ in range(8)]
        for i, sock in enumerate(stalled):
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n" if i % 2 else
                         head("/v1/completions", 1000, key="sk-alice") + b'{"prompt": ')
        assert timed_completion(bob, model) < 3
        for sock in stalled:
            status, _, _ = read_response(sock)
            assert status == 408 and closed_by_server(sock, 5)
            sock.close()

        # strict bodies: answered at once, never forwarded, never a 500
        raw = httpx.Client(base_url=url, headers={"Authorization": "Bearer sk-alice",
                                                  "Content-Type": "application/json"}, timeout=30)
        messages = '"messages": [{"role": "user", "content": "hi"}]'
        for body, param in ((f'{{{messages}, "temperature": 1e400}}', "temperature"),
                            (f'{{{messages}, "temperature": NaN}}', "temperature"),
                            (f'{{{messages}, "stop": "\\ud800"}}', "stop"),
                            (f'{{{messages}, "model": "\\ud800"}}', "model"),
                            (f'{{{messages}, "max_tokens": true}}', "max_tokens")):
            started = time.monotonic()
            resp = raw.post("/v1/chat/completions", content=body)
            assert (resp.status_code, resp.json()["error"]["param"]) == (400, param)
            assert time.monotonic() - started < 1
        with pytest.raises(openai.BadRequestError) as e:
            alice.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens="5")
        assert e.value.param == "max_tokens"
        detail = httpx.get(url + "/health", headers=ADMIN, timeout=10).json()
        assert (detail["in_flight"], detail["transfers_in_flight"]) == (0, 0)

        # paths and docs
        for path in ("/v1/chat%2Fcompletions", "/v1/chat/completions/"):
            resp = raw.post(path, content=f"{{{messages}}}")
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "invalid_request_error"
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(url + path, timeout=10).status_code == 404

        # least exposure
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        assert httpx.get(url + "/health", headers={"Authorization": "Bearer sk-bob"}, timeout=10).json() == {
            "status": "ok"}
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401
        assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-bob"}, timeout=10).status_code == 403
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-prom"}, timeout=10).text
        assert 'kvfence_auth_failures_total{reason="missing_key"}' in metrics
        assert 'kvfence_requests_total{status="413",tenant="alice"} 4.0' in metrics

        # a worker dies mid-stream: the client's error names no address
        [decode_pid] = [w["pid"] for w in detail["workers"].values() if w["role"] == "decode"]
        stream = alice.completions.create(model=model, prompt="Once upon a time", max_tokens=400, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(decode_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:
            list(stream)
        assert "died" in str(e.value) and "tcp://" not in str(e.value) and "127.0.0.1" not in str(e.value)
        assert "sk-" not in server.output()

    records = [json.loads(line) for line in audit.read_text().splitlines()]
    by_status = {}
    for r in records:
        by_status.setdefault((r["tenant"], r["status"]), 0)
        by_status[(r["tenant"], r["status"])] += 1
    assert by_status[("alice", 413)] == 4 and by_status[("alice", 408)] == 4 and by_status[("alice", 400)] == 6


def test_one_address_cannot_hold_more_than_its_connections(tmp_path):
    with Server("--model", str(tiny_model_dir("llama")), "--max-context", "256", "--kv-pool-tokens", "1024",
                "--mode", "colocated", "--max-connections-per-client", "4", "--header-timeout", "30") as server:
        held = [connect(server.url) for _ in range(4)]
        for sock in held:  # an answer on each, kept alive: the server has counted all four
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(sock)[0] == 200
        with connect(server.url) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(extra)[0] == 429
        for sock in held:
            sock.close()
        wait_until(lambda: httpx.get(server.url + "/health", timeout=10).status_code == 200, 10,
                   "the server to count the closes and serve this address again")
