"""L0 preflight: the capacity math, ``preflight``, and ``kvfence audit`` in its three forms.

The --url forms run against real local HTTP servers that serve fixed JSON (fakes of the remote kvfence or SGLang
server only; the code under test is real), and one test runs the CLI as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from tiny_models import TINY, tiny_model_dir

from kvfence.cli import main
from kvfence.config import ModelConfig
from kvfence.kvcache.layout import TAG_BYTES, KVLayout
from kvfence.preflight import PreflightError, pool_tokens_for_memory, preflight, usable_pool_tokens
from kvfence.tools.audit import describe, parse_bytes

ROOT = Path(__file__).resolve().parent.parent
GIB, MIB = 2**30, 2**20


def shape(num_layers: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    """A config with only the KV shape that matters here."""
    return ModelConfig(arch="llama", vocab_size=1, hidden_size=num_kv_heads * head_dim, intermediate_size=1,
                       num_layers=num_layers, num_heads=num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       rope_theta=1e4, rms_norm_eps=1e-6, max_context=8192, tie_word_embeddings=True)


SMOLLM2 = shape(30, 3, 64)


def tiny() -> str:
    return str(tiny_model_dir("llama"))


# -- capacity math -----------------------------------------------------------------------------------


@pytest.mark.fast
def test_usable_pool_tokens_counts_whole_pages_only():
    assert usable_pool_tokens(681_280, 16) == 681_280
    assert usable_pool_tokens(1000, 16) == 992
    assert usable_pool_tokens(15, 16) == 0


@pytest.mark.fast
def test_pool_from_memory_smollm2_shape():
    assert SMOLLM2.kv_bytes_per_token(2) == 23_040  # 2 (K,V) x 30 layers x 3 heads x 64 x 2 bytes
    # a page: 16 x 23,040 bytes of K/V + a 64-byte tag record = 368,704 bytes; 2 GiB holds 5,824 of them
    assert pool_tokens_for_memory(2 * GIB, SMOLLM2, 16, 2) == 5_824 * 16 == 93_184
    assert pool_tokens_for_memory(2 * GIB, SMOLLM2, 16, 4) == 2_912 * 16 == 46_592  # float32
    assert pool_tokens_for_memory(368_704 * 3 - 1, SMOLLM2, 16, 2) == 2 * 16  # one byte short of a third page


@pytest.mark.fast
def test_pool_from_memory_matches_what_a_worker_allocates():
    """The pool a budget gives is the largest whose region (pages + tags, ``KVLayout.nbytes``) fits in it."""
    for cfg, page_size, dtype_bytes, budget in ((SMOLLM2, 16, 2, 2 * GIB), (SMOLLM2, 32, 4, 3 * GIB + 12_345),
                                                (shape(2, 2, 16), 16, 2, 512 * MIB)):
        pages = pool_tokens_for_memory(budget, cfg, page_size, dtype_bytes) // page_size
        assert KVLayout.of(cfg, pages, page_size, dtype_bytes).nbytes <= budget
        assert KVLayout.of(cfg, pages + 1, page_size, dtype_bytes).nbytes > budget
        assert KVLayout.of(cfg, pages, page_size, dtype_bytes).nbytes == \
            pages * (page_size * cfg.kv_bytes_per_token(dtype_bytes) + TAG_BYTES)


@pytest.mark.slow
def test_pool_from_memory_tiny_config():
    _, cfg = describe(tiny())
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (TINY["num_hidden_layers"],
                                                                TINY["num_key_value_heads"], 16)
    assert cfg.kv_bytes_per_token(2) == 256  # 2 x 2 layers x 2 heads x 16 x 2 bytes
    # a page: 16 x 256 + 64 = 4,160 bytes; 512 MiB holds 129,055 of them
    assert pool_tokens_for_memory(512 * MIB, cfg, 16, 2) == 129_055 * 16 == 2_064_880
    assert pool_tokens_for_memory(2 * MIB, cfg, 16, 2) == 504 * 16


@pytest.mark.fast
def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 * MIB
    assert parse_bytes("2GiB") == 2 * GIB
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1073741824") == GIB
    for bad in ("2 gigs", "GiB", "-1MiB", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


# -- preflight -----------------------------------------------------------------------------------------


@pytest.mark.fast
def test_preflight_refuses_the_incident_configuration():
    with pytest.raises(PreflightError) as caught:
        preflight("prefill", 681_280, 1_048_576)
    e = caught.value
    assert (e.role, e.pool_tokens, e.max_context, e.layer) == ("prefill", 681_280, 1_048_576, "preflight")
    assert "prefill KV pool holds 681280 tokens" in e.message and "context of 1048576 tokens" in e.message
    assert "raise --prefill-pool-tokens to at least 1048576 or lower --max-context to at most 681280" in e.message


@pytest.mark.fast
def test_preflight_passes_a_pool_that_holds_the_context_and_rounds_its_fix_up_to_a_page():
    preflight("decode", 4096, 4096)
    preflight("colocated", 4112, 4096)
    with pytest.raises(PreflightError, match="raise --decode-pool-tokens to at least 1008 "):
        preflight("decode", 992, 1000, page_size=16)
    with pytest.raises(PreflightError, match="raise --kv-pool-tokens to at least 4096 "):
        preflight("colocated", 4080, 4096)


@pytest.mark.model
def test_an_engine_built_in_code_runs_the_preflight_and_only_the_switch_lets_it_start():
    """L0 is on the serving path, not only on the command line: every engine (colocated, prefill, decode) checks its
    own pool when it is built."""
    import torch

    from kvfence.config import EngineConfig
    from kvfence.engine.engine import Engine
    from kvfence.model.loader import load_model
    from kvfence.safety import Safety

    tiny = load_model(str(tiny_model_dir("llama")), dtype=torch.float32)
    config = EngineConfig(max_context=256, kv_pool_tokens=128, page_size=16, role="decode")
    with pytest.raises(PreflightError, match="the decode KV pool holds 128 tokens, fewer than the context of 256"):
        Engine(tiny.model, tiny.tokenizer, config, torch.float32, safety=Safety())
    engine = Engine(tiny.model, tiny.tokenizer, config, torch.float32, safety=Safety(preflight=False))
    assert engine.token_limit == 128  # L1 then bounds every request by the pool


# -- kvfence audit: a planned deployment -------------------------------------------------------------------


def audit(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["audit", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_flags_incident_like_prefill_pool_is_undersized(capsys):
    rc, out, _ = audit(capsys, "--model", tiny(), "--prefill-pool-tokens", "1024", "--max-context", "4096",
                       "--prefill", "2")
    assert rc == 1
    rows = [line.split() for line in out.splitlines() if line.startswith(("prefill ", "decode "))]
    assert rows == [["prefill", "prefill-0", "1,024", "4,096", "UNDERSIZED", "(3,072", "short)"],
                    ["prefill", "prefill-1", "1,024", "4,096", "UNDERSIZED", "(3,072", "short)"],
                    ["decode", "decode-0", "8,192", "4,096", "OK"]]
    assert "UNDERSIZED: 2 of 3 nodes" in out
    assert out.count("fix (prefill): raise --prefill-pool-tokens to at least 4096") == 1


@pytest.mark.slow
def test_flags_default_pools_and_context_are_ok(capsys):
    """Defaults as ``kvfence serve``'s: the model's context (4,096 here), a prefill pool of 1 x that, decode 2 x.

    (The default model, SmolLM2, has the shape of ``SMOLLM2`` above; reading its GGUF metadata takes seconds.)
    """
    rc, out, _ = audit(capsys, "--model", tiny(), "--json")
    assert rc == 0
    report = json.loads(out)
    assert report["ok"] and "2 layers x 2 KV heads x 16, bfloat16" in report["sources"][0]
    assert [(n["node"], n["pool_tokens"], n["max_context"]) for n in report["nodes"]] == [
        ("prefill-0", 4_096, 4_096), ("decode-0", 8_192, 4_096)]


@pytest.mark.slow
def test_flags_pool_memory_and_the_most_specific_flag_wins(capsys):
    rc, out, _ = audit(capsys, "--model", tiny(), "--pool-memory", "2MiB", "--decode-pool-tokens", "100",
                       "--max-context", "96", "--json")
    nodes = {n["node"]: n for n in json.loads(out)["nodes"]}
    assert rc == 0 and nodes["prefill-0"]["pool_tokens"] == 8064 and nodes["decode-0"]["pool_tokens"] == 96
    rc, out, _ = audit(capsys, "--model", tiny(), "--prefill-pool-memory", "4160", "--json")
    assert rc == 1 and json.loads(out)["nodes"][0]["pool_tokens"] == 16


@pytest.mark.slow
def test_flags_colocated(capsys):
    rc, out, _ = audit(capsys, "--model", tiny(), "--mode", "colocated", "--kv-pool-tokens", "4095")
    assert rc == 1 and "colocated  colocated-0" in out
    assert "fix (colocated): raise --kv-pool-tokens to at least 4096 or lower --max-context to at most 4080" in out


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["--prefill-pool-tokens", "10", "--prefill-pool-memory", "1GiB"], "tokens or in memory, not both"),
    (["--max-context", "5000"], "must be between 1 and the model's context length (4096)"),
    (["--prefill", "0", "--decode", "0"], "no nodes to audit"),
    (["--url", "http://127.0.0.1:9", "--kv-pool-tokens", "10"], "pool flags describe a planned deployment"),
])
def test_flags_usage_errors_exit_2(capsys, argv, message):
    rc, _, err = audit(capsys, "--model", tiny(), *argv)
    assert rc == 2 and message in err


@pytest.mark.fast
def test_flags_bad_values_exit_2_from_argparse(capsys):
    for argv in (["--page-size", "0"], ["--pool-memory", "lots"]):
        with pytest.raises(SystemExit) as caught:
            main(["audit", *argv])
        assert caught.value.code == 2
    capsys.readouterr()


@pytest.mark.fast
@pytest.mark.parametrize("argv", [["--page-size", "0"], ["--chunk-size", "0"], ["--step-tokens", "0"],
                                  ["--max-batch", "0"], ["--kv-pool-tokens", "-5"], ["--prefill", "0"],
                                  ["--threads", "-1"], ["--max-context", "0"], ["--step-tokens", "many"]])
def test_serve_refuses_sizes_that_would_hang_or_crash_it(capsys, argv):
    """A zero step budget or batch never admitted a request, a zero page size divided by zero, and a zero chunk
    size crashed the prefill worker in a loop: argparse now stops them before anything starts."""
    with pytest.raises(SystemExit) as caught:
        main(["serve", *argv])
    assert caught.value.code == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err


# -- kvfence audit --url: fake remote servers -----------------------------------------------------------------


class FakeServer:
    """A local HTTP server answering GET ``path`` with ``routes[path]`` = (status, JSON body or None: empty)."""

    def __init__(self, routes: dict[str, tuple[int, object]], key: str | None = None) -> None:
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization header) per request
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                auth = self.headers.get("Authorization")
                fake.seen.append((self.path, auth))
                status, body = routes.get(self.path, (404, {"detail": "Not Found"}))
                if key is not None and auth != f"Bearer {key}":
                    status, body = 401, {"error": "bad key"}
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def kvfence_health(workers: dict, status: str = "ok", max_context: int = 4096) -> dict:
    return {"status": status, "mode": "disaggregated", "max_context": max_context, "in_flight": 0,
            "workers": workers, "safety_layers_off": []}


def worker(role: str, pool_tokens: int, max_context: int = 4096) -> dict:
    return {"role": role, "pid": 1, "in_flight": 0, "assigned": 0, "free_pages": 0, "running": 0,
            "pool_tokens": pool_tokens, "max_context": max_context}


def sglang_info(pool: int, context: int | None, mode: str = "null", page_size: int = 1, port: int = 30000) -> dict:
    """The fields ``kvfence audit`` reads from SGLang's server info, among some it ignores."""
    return {"model_path": "zai-org/GLM", "host": "10.0.0.1", "port": port, "context_length": context,
            "page_size": page_size, "disaggregation_mode": mode, "max_total_num_tokens": pool,
            "max_req_input_len": min(pool, context or pool) - 6, "internal_states": [{"last_gen_throughput": 0.0}],
            "version": "0.4.9"}


@pytest.mark.slow
def test_url_kvfence_disaggregated(capsys):
    workers = {"decode-a": worker("decode", 16_384), "prefill-b": worker("prefill", 1_030, max_context=2048),
               "prefill-a": worker("prefill", 8_192, max_context=8192)}
    with FakeServer({"/health": (200, kvfence_health(workers))}) as server:
        rc, out, _ = audit(capsys, "--url", server.url + "/", "--json")
    report = json.loads(out)
    assert rc == 1 and report["sources"] == [f"kvfence (disaggregated, status 'ok') at {server.url}"]
    # pools round down to whole pages of --page-size; each worker must hold max(router context, its own)
    assert [(n["role"], n["node"], n["pool_tokens"], n["max_context"], n["ok"]) for n in report["nodes"]] == [
        ("prefill", "prefill-a", 8_192, 8_192, True), ("prefill", "prefill-b", 1_024, 4_096, False),
        ("decode", "decode-a", 16_384, 4_096, True)]


@pytest.mark.slow
def test_url_kvfence_colocated_and_context_override(capsys):
    health = {"status": "ok", "mode": "colocated", "max_context": 4096, "kv_pool_tokens": 16_384}
    with FakeServer({"/health": (200, health)}) as server:
        assert audit(capsys, "--url", server.url)[0] == 0
        rc, out, _ = audit(capsys, "--url", server.url, "--max-context", "20000")
    assert rc == 1 and "UNDERSIZED (3,616 short)" in out


@pytest.mark.slow
def test_url_kvfence_without_workers_exits_2(capsys):
    with FakeServer({"/health": (503, kvfence_health({}, status="waiting for workers"))}) as server:
        rc, _, err = audit(capsys, "--url", server.url)
    assert rc == 2 and "no workers have joined" in err


@pytest.mark.slow
def test_url_sglang_prefill_node_of_the_incident(capsys):
    """SGLang answers /health with an empty 200; newer versions serve /server_info, older /get_server_info."""
    info = sglang_info(681_280, 1_048_576, mode="prefill", page_size=64)
    with FakeServer({"/health": (200, None), "/get_server_info": (200, info)}) as server:
        rc, out, _ = audit(capsys, "--url", server.url)
    assert rc == 1
    assert f"audit: SGLang 0.4.9 at {server.url}" in out
    row = next(line for line in out.splitlines() if line.startswith("prefill "))
    assert row.split() == ["prefill", "10.0.0.1:30000", "681,280", "1,048,576", "UNDERSIZED", "(367,296", "short)"]
    assert [path for path, _ in server.seen] == ["/health", "/server_info", "/get_server_info"]


@pytest.mark.slow
def test_url_sglang_context_from_v1_models_when_not_set(capsys):
    models = {"object": "list", "data": [{"id": "m", "max_model_len": 131_072}]}
    with FakeServer({"/server_info": (200, sglang_info(200_000, None)), "/v1/models": (200, models)}) as server:
        rc, out, _ = audit(capsys, "--url", server.url, "--json")
    node = json.loads(out)["nodes"][0]
    assert rc == 0 and (node["role"], node["pool_tokens"], node["max_context"]) == ("colocated", 200_000, 131_072)
    with FakeServer({"/server_info": (200, sglang_info(200_000, None))}) as server:
        rc, _, err = audit(capsys, "--url", server.url)
    assert rc == 2 and "pass the context it serves with --max-context" in err


@pytest.mark.slow
def test_url_sglang_pd_load_balancer_audits_every_backend(capsys):
    lb = {"internal_states": [], "prefill": [sglang_info(681_280, 1_048_576, "prefill", 64, 30001)],
          "decode": [sglang_info(2_000_010, 1_048_576, "decode", 64, 30002),
                     sglang_info(1_048_600, 1_048_576, "decode", 64, 30003)]}
    with FakeServer({"/health": (200, None), "/server_info": (200, lb)}) as server:
        rc, out, _ = audit(capsys, "--url", server.url, "--json")
    nodes = json.loads(out)["nodes"]
    assert rc == 1
    assert [(n["role"], n["node"], n["pool_tokens"], n["ok"]) for n in nodes] == [
        ("prefill", "10.0.0.1:30001", 681_280, False), ("decode", "10.0.0.1:30002", 2_000_000, True),
        ("decode", "10.0.0.1:30003", 1_048_576, True)]


@pytest.mark.slow
def test_url_sends_the_key_and_asks_for_it(capsys):
    routes = {"/server_info": (200, sglang_info(10_000, 4096))}
    with FakeServer(routes, key="sk-ops") as server:
        rc, _, err = audit(capsys, "--url", server.url)
        assert rc == 2 and "pass the server's API key with --key" in err
        assert audit(capsys, "--url", server.url, "--key", "sk-ops")[0] == 0
    assert server.seen[-1] == ("/server_info", "Bearer sk-ops")


@pytest.mark.slow
def test_url_unknown_or_unreachable_server_exits_2(capsys):
    with FakeServer({"/health": (200, {"status": "fine"})}) as server:
        rc, _, err = audit(capsys, "--url", server.url)
    assert rc == 2 and "neither a kvfence server" in err
    rc, _, err = audit(capsys, "--url", server.url)  # closed now
    assert rc == 2 and "cannot reach" in err


@pytest.mark.slow
def test_url_several_servers_in_one_audit(capsys):
    with FakeServer({"/server_info": (200, sglang_info(1_048_576, 1_048_576, "prefill"))}) as p, \
            FakeServer({"/server_info": (200, sglang_info(1_048_576, 1_048_576, "decode"))}) as d:
        rc, out, _ = audit(capsys, "--url", p.url, "--url", d.url)
    assert rc == 0 and "OK: all 2 nodes hold one request of the full context" in out


@pytest.mark.slow
def test_cli_subprocess_audits_a_running_server():
    info = sglang_info(681_280, 1_048_576, mode="prefill", page_size=64)
    with FakeServer({"/server_info": (200, info)}) as server:
        proc = subprocess.run([sys.executable, "-m", "kvfence.cli", "audit", "--url", server.url, "--json"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert not report["ok"] and report["nodes"][0]["shortfall"] == 367_296
    assert report["nodes"][0]["fix"] == ("raise --prefill-pool-tokens to at least 1048576 "
                                         "or lower --max-context to at most 681280")
