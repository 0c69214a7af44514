"""The incident (docs/safety.md), reproduced through real processes and the real SmolLM2.

``--emulate-incident`` restores the placeholder path: the prefill worker rejects an over-length prompt, yet
computes a 1-token placeholder and reports its transfer complete into pages decode granted for the whole
prompt. The prefill pool (1,024 tokens) is smaller than the context (4,096), as in the incident, and the
decode pool is just large enough that the attacker's pages are the victim's freed, unscrubbed pages.

With every layer off, tenant bob's over-length prompt gets HTTP 200 and text decoded from tenant alice's KV.
With the layers on, bob gets a 400 ``context_length_exceeded`` and nothing of alice's. With L0 on, such a
deployment does not even start.
"""

import os
import subprocess
import sys

import openai
import pytest

from kvfence.model.loader import describe_model
from tests.server import ROOT, Server

pytestmark = pytest.mark.slow


DOCUMENT = " ".join(f"Section {i}: The quarterly report covers logistics, staffing and budgets for the northern "
                    "region." for i in range(60))
CANARY = "Repeat exactly: the secret code is ZEBRA-4471."
# Distinctive pieces of alice's prompt that bob's own prompt (a lighthouse story) cannot produce.
ALICE_FRAGMENTS = ("ZEBRA", "4471", "secret code", "quarterly report", "northern region", "logistics", "staffing")
INCIDENT_FLAGS = ("--emulate-incident", "--prefill-pool-tokens", "1024", "--max-context", "4096",
                  "--decode-pool-tokens", "1088", "--tenants")
GREEDY = dict(model="smollm2-135m", temperature=0, max_tokens=30)


def fit(content: str, suffix: str, most_tokens: int) -> list[dict]:
    """A one-message chat of at most ``most_tokens`` tokens: ``content`` trimmed from the end, then ``suffix``."""
    tokenizer = describe_model("smollm2-135m")[2]
    while True:
        messages = [{"role": "user", "content": content + suffix}]
        if len(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))) <= most_tokens:
            return messages
        content = content[:-20]


ALICE = fit(DOCUMENT, "\n" + CANARY, 1000)  # fits the 1,024-token prefill pool
BOB = fit("Tell me a short story about a lighthouse keeper. " * 100, "", 1040)  # just over it


def alice_then_bob(server: Server) -> openai.APIResponse:
    """Alice's request runs to its end (freeing her pages), then bob sends his over-length prompt."""
    alice = server.client("sk-alice").chat.completions.create(messages=ALICE, **GREEDY)
    assert alice.choices[0].finish_reason in ("stop", "length")
    return server.client("sk-bob").chat.completions.with_raw_response.create(messages=BOB, **GREEDY)


def test_every_layer_off_leaks_alices_kv_into_bobs_200(tenants_file):
    with Server(*INCIDENT_FLAGS, str(tenants_file), env={"KVFENCE_UNSAFE": "all"}, ready_timeout=300) as server:
        health = server.health("sk-admin")  # announced in /health's detail, to admins, by every process
        assert health["safety_layers_off"]
        assert {w["role"]: w["safety_layers_off"] for w in health["workers"].values()} == {
            "prefill": health["safety_layers_off"], "decode": health["safety_layers_off"]}
        raw = alice_then_bob(server)
        text = raw.parse().choices[0].message.content
        assert raw.status_code == 200  # the wrong status: bob's prompt is over the prefill pool
        leaked = [f for f in ALICE_FRAGMENTS if f.lower() in text.lower()]
        assert leaked, f"expected text from alice's stale KV in bob's answer, got {text!r}"
        assert "KVFENCE_UNSAFE" in server.output()  # and announced loudly at start


def test_with_the_layers_on_bob_gets_400_and_nothing_of_alice(tenants_file):
    # L0 would refuse to start this undersized deployment at all (next test); every other layer is on.
    with Server(*INCIDENT_FLAGS, str(tenants_file), env={"KVFENCE_UNSAFE": "preflight"}, ready_timeout=300) as server:
        with pytest.raises(openai.BadRequestError) as caught:
            alice_then_bob(server)
        error = caught.value.body
        assert caught.value.status_code == 400 and error["code"] == "context_length_exceeded"
        assert "1024" in error["message"]  # the real limit and the real token counts
        assert not any(f.lower() in str(error).lower() for f in ALICE_FRAGMENTS)


def test_with_preflight_on_the_undersized_deployment_refuses_to_start(tenants_file):
    cmd = [sys.executable, "-m", "kvfence.cli", "serve", *INCIDENT_FLAGS, str(tenants_file)]
    env = {k: v for k, v in os.environ.items() if k != "KVFENCE_UNSAFE"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "prefill KV pool holds 1024 tokens" in done.stderr and "--prefill-pool-tokens" in done.stderr

