"""The command line as a vLLM user expects it: --version, --api-key, --max-model-len, --chat-template, global flags
after the subcommand, a KVFENCE_* variable for every flag, and one-line errors for a wrong --model."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest

from kvfence.cli import build_parser
from kvfence.model.describe import describe_model
from tests.server import ROOT, Server
from tests.tiny_models import tiny_model_dir


def kvfence(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfence.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_version():
    run = kvfence("--version")
    assert run.returncode == 0 and run.stdout.startswith("kvfence ")


@pytest.mark.slow
@pytest.mark.parametrize("model, says", [("/no/such/model", "no file or directory /no/such/model"),
                                         ("/tmp", "has no config.json"),
                                         (__file__, "not a .gguf one")])
def test_a_wrong_model_is_one_line_saying_what_was_tried_and_what_exists(model, says):
    run = kvfence("serve", "--model", model, "--mode", "colocated")
    assert run.returncode != 0
    [line] = [ln for ln in run.stderr.splitlines() if ln.startswith("kvfence: --model")]
    assert says in line and "'smollm2-135m'" in line and "Traceback" not in run.stderr


@pytest.mark.fast
def test_every_flag_reads_a_kvfence_variable_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("KVFENCE_PORT", "9123")
    monkeypatch.setenv("KVFENCE_DOCS", "yes")
    monkeypatch.setenv("KVFENCE_MAX_CONTEXT", "256")
    monkeypatch.setenv("KVFENCE_LOG_LEVEL", "WARNING")
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.docs, args.max_context, args.log_level) == (9123, True, 256, "WARNING")
    args = build_parser().parse_args(["serve", "--port", "9000", "--max-model-len", "128"])
    assert (args.port, args.max_context) == (9000, 128)
    monkeypatch.setenv("KVFENCE_ROUTER", "tcp://127.0.0.1:5550")  # a required flag, given by the environment
    assert build_parser().parse_args(["decode"]).router == "tcp://127.0.0.1:5550"


@pytest.mark.slow
@pytest.mark.parametrize("name, value", [("KVFENCE_PORT", "eighty"), ("KVFENCE_DOCS", "maybe"),
                                         ("KVFENCE_TRANSFER", "carrier-pigeon")])
def test_a_bad_kvfence_variable_is_a_usage_error_naming_it(name, value):
    run = kvfence("serve", "--help", env={name: value})
    assert run.returncode == 2 and name in run.stderr


@pytest.mark.fast
def test_prefix_caching_is_on_unless_turned_off_by_flag_or_variable(monkeypatch):
    parse = build_parser().parse_args
    assert parse(["serve"]).enable_prefix_caching and parse(["prefill", "--router", "ipc://r"]).enable_prefix_caching
    assert not parse(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching
    monkeypatch.setenv("KVFENCE_ENABLE_PREFIX_CACHING", "0")
    assert not build_parser().parse_args(["serve"]).enable_prefix_caching
    assert build_parser().parse_args(["serve", "--enable-prefix-caching"]).enable_prefix_caching


@pytest.mark.fast
def test_global_flags_are_accepted_after_the_subcommand():
    assert build_parser().parse_args(["serve", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert build_parser().parse_args(["--log-level", "ERROR", "serve"]).log_level == "ERROR"
    assert build_parser().parse_args(["serve"]).log_level == "INFO"


@pytest.mark.slow
def test_api_key_and_chat_template_on_a_real_server(tmp_path):
    model = str(tiny_model_dir("llama"))
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with Server("--mode", "colocated", "--model", model, "--max-context", "256", "--api-key", "sk-only",
                "--chat-template", str(template)) as server:
        with pytest.raises(openai.AuthenticationError):
            server.client("sk-wrong").models.list()
        reply = server.client("sk-only").chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hello world"}], max_tokens=2)
    assert reply.usage.prompt_tokens == len(describe_model(model)[2].encode("hello world"))


@pytest.mark.slow
def test_api_key_and_tenants_exclude_each_other():
    run = kvfence("serve", "--api-key", "k", "--tenants", "t.toml")
    assert run.returncode != 0 and "--api-key and --tenants" in run.stderr
