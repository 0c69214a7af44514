"""``kvfence soak`` end to end on a tiny model: every fault kind comes back clean, and a layer off is caught.

Each run starts two real servers (reference, then under faults) with real worker processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server import ROOT
from tests.tiny_models import tiny_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def soak(tmp_path, *flags: str, unsafe: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "report.json"
    env = {**os.environ, "KVFENCE_UNSAFE": unsafe}
    cmd = [sys.executable, "-m", "kvfence.cli", "soak", "--model", str(tiny_model_dir("llama")), "--seed", "3",
           "--max-context", "256", "--workdir", str(tmp_path), "--json", str(report), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert report.exists(), proc.stderr[-3000:]
    return proc, json.loads(report.read_text())


def test_a_short_soak_with_every_fault_kind_comes_back_clean(tmp_path):
    proc, report = soak(tmp_path, "--requests", "240", "--concurrency", "8", "--kills", "2", "--pauses", "2",
                        "--worker-timeout", "4", "--handoff-timeout", "3", "--disconnect", "0.08",
                        "--faults", "drop=0.004,dup=0.01,delay=0.02,delay_s=0.3,flip=0.15")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert report["findings"] == []
    out = report["outcomes"]
    # every fault kind really happened
    assert {k["role"] for k in report["kills"]} == {"prefill", "decode"}
    assert any(k["transfers_in_flight"] for k in report["kills"])
    assert [(p["role"], bool(p["fenced_at"] and p["back_at"])) for p in report["pauses"]] == [
        ("decode", True), ("prefill", True)]  # each paused worker was fenced, then came back (checked by the soak)
    assert report["verification_failures"].get("checksum", 0) >= 1  # flipped bytes caught on landing
    assert out["client_left"].get("handoff", 0) >= 1 and out["client_left"].get("stream", 0) >= 1
    assert out["statuses"]["400"] == out["over_length"]
    assert out["statuses"]["200"] > out["requests"] / 3
    assert "hung" not in out["ended"]
    assert out["audit_statuses"]  # one record per request, checked by the soak itself
    assert all(p["total_pages"] == p["free_pages"] + p["quarantined_pages"] for p in report["pools"].values())
    # ~20 caught flips of 1-3 pages each in a default pool of 32 pages: they come back once prefill acks the abort
    assert all(p["quarantined_pages"] <= p["total_pages"] // 4 for p in report["pools"].values()), report["pools"]


def test_with_the_checksum_layer_off_flipped_bytes_reach_clients_and_the_soak_says_so(tmp_path):
    proc, report = soak(tmp_path, "--requests", "60", "--concurrency", "4", "--kills", "0", "--pauses", "0",
                        "--disconnect", "0", "--faults", "flip=0.5", unsafe="checksum")
    assert proc.returncode == 1, proc.stdout
    kinds = {f["kind"] for f in report["findings"]}
    assert "incoherent" in kinds and kinds <= {"incoherent", "not serving"}, report["findings"]  # flips go on after
    assert report["verification_failures"].get("checksum", 0) == 0
