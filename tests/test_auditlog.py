"""The audit log: writing (incl. concurrent writers), reading, and every filter of ``kvfence audit-log``."""

from __future__ import annotations

import argparse
import threading
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from kvfence.auditlog import AuditLog, AuditRecord, read_records, rid_hex
from kvfence.cli import main
from kvfence.tools.auditlog import Query, parse_status, parse_time

pytestmark = pytest.mark.fast


T0 = 1_790_000_000.0  # 2026-09-21T14:13:20Z
POOL = 681_280  # the incident's prefill pool


def record(**kw) -> AuditRecord:
    fields = dict(time=T0, tenant="alice", rid=rid_hex(1), model="m", endpoint="/v1/chat/completions",
                  prompt_tokens=10, output_tokens=5, max_tokens=16, admission="accepted", status=200,
                  finish_reason="stop", prefill="prefill-0", decode="decode-0", pages=[(3, 7)], verification="ok",
                  duration_s=0.25)
    return AuditRecord(**(fields | kw))


def rejected(**kw) -> AuditRecord:
    return record(**({"admission": "rejected", "decided_by": "admission", "status": 400,
                      "error_code": "context_length_exceeded", "error": "too long", "output_tokens": 0,
                      "finish_reason": None, "prefill": None, "decode": None, "pages": [], "verification": "n/a"}
                     | kw))


def read(path: Path) -> tuple[list[AuditRecord], list[str]]:
    problems: list[str] = []
    with open(path, "rb") as f:
        return list(read_records(f, problems)), problems


# -- writing ---------------------------------------------------------------------------------------------------


def test_round_trip_and_the_line_format(tmp_path):
    path = tmp_path / "audit.jsonl"
    records = [record(), rejected(rid=rid_hex(2**128 - 1)), record(verification="skipped: tags,checksum off")]
    with AuditLog(path) as log:
        for r in records:
            log.write(r)
    assert read(path) == (records, [])
    first = msgspec.json.decode(path.read_bytes().splitlines()[0])
    assert list(first) == ["time", "tenant", "rid", "model", "endpoint", "prompt_tokens", "output_tokens",
                           "max_tokens", "admission", "decided_by", "status", "error_code", "error",
                           "finish_reason", "prefill", "decode", "decode_epoch", "pages", "verification", "duration_s"]
    assert first["rid"] == "0" * 31 + "1" and first["pages"] == [[3, 7]] and first["decided_by"] is None
    assert records[1].rid == "f" * 32


def test_each_write_is_in_the_file_at_once_and_the_file_is_appended_to(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_bytes(msgspec.json.encode(record(tenant="before")) + b"\n")
    log = AuditLog(path)
    log.write(record(tenant="now"))
    assert [r.tenant for r in read(path)[0]] == ["before", "now"]  # not closed yet: already flushed
    log.close()
    log.close()
    with AuditLog(str(path)) as again:
        again.write(record(tenant="later"))
    assert [r.tenant for r in read(path)[0]] == ["before", "now", "later"]


def test_null_log_writes_nothing(tmp_path):
    for log in (AuditLog.null(), AuditLog(None)):
        assert not log.enabled
        log.write(record())
        log.close()
    assert AuditLog(tmp_path / "a.jsonl").enabled


def test_concurrent_writers_never_interleave_lines(tmp_path):
    path = tmp_path / "audit.jsonl"
    threads, each = 8, 150
    log = AuditLog(path)

    def writer(i: int) -> None:
        for n in range(each):  # long lines (~9 KB): a torn or interleaved write would show
            log.write(record(tenant=f"t{i}", rid=rid_hex(i * each + n), error=str(i) * 9000))

    workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    log.close()
    records, problems = read(path)
    assert problems == [] and len(path.read_bytes().splitlines()) == threads * each
    assert Counter(r.tenant for r in records) == {f"t{i}": each for i in range(threads)}
    assert all(r.error == r.tenant[1:] * 9000 for r in records)
    assert len({r.rid for r in records}) == threads * each


# -- reading ------------------------------------------------------------------------------------------------------


def test_malformed_lines_are_reported_by_number_and_skipped(tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    good = msgspec.json.encode(record()).decode()
    path.write_text("\n".join([good, "{not json", '{"tenant": "x"}', "", good.replace('"status":200',
                                                                                   '"status":"200"'), good]) + "\n")
    records, problems = read(path)
    assert len(records) == 2
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 3", "line 5"]
    assert "missing required field" in problems[1] and "Expected `int`, got `str`" in problems[2]
    assert main(["audit-log", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err.count("; skipped") == 3 and f"{path}: line 5:" in err
    assert out.splitlines()[-1] == "2 of 2 records match; 3 malformed lines skipped"


def test_missing_file_exits_2(tmp_path, capsys):
    assert main(["audit-log", str(tmp_path / "nope.jsonl")]) == 2
    assert "No such file" in capsys.readouterr().err


# -- filters ------------------------------------------------------------------------------------------------------


def test_every_filter():
    a = record(tenant="alice", prompt_tokens=100, time=T0, status=200)
    b = rejected(tenant="bob", prompt_tokens=5000, time=T0 + 60)
    c = record(tenant="carol", prompt_tokens=700_000, time=T0 + 120, status=500, decided_by="tags",
               verification="failed: tags: page 3")
    records = [a, b, c]

    def keep(**kw) -> list[AuditRecord]:
        return [r for r in records if Query(**kw).matches(r)]

    assert keep() == records
    assert keep(min_prompt_tokens=5000) == [b, c]
    assert keep(tenants=frozenset({"alice", "carol"})) == [a, c]
    assert keep(since=T0 + 60) == [b, c] and keep(until=T0 + 60) == [a, b] and keep(since=T0 + 1, until=T0 + 119) == [b]
    assert keep(statuses=((400, 400),)) == [b] and keep(statuses=((200, 299), (500, 599))) == [a, c]
    assert keep(decided_by="admission") == [b] and keep(decided_by="tags") == [c] and keep(decided_by="none") == [a]
    assert keep(min_prompt_tokens=1000, statuses=((200, 299),)) == []


def test_parse_time_and_status():
    assert parse_time("1790000000") == T0 and parse_time("1790000000.5") == T0 + 0.5
    assert parse_time("2026-09-21T14:13:20Z") == T0 == parse_time("2026-09-21T14:13:20")  # no zone: UTC
    assert parse_time("2026-09-21T16:13:20+02:00") == T0
    assert parse_status("2xx") == (200, 299) and parse_status("5XX") == (500, 599) and parse_status("429") == (429, 429)
    for bad_time in ("yesterday", "2026-13-01"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_time(bad_time)
    for bad_status in ("ok", "6xx", "20", "2000"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_status(bad_status)


def write_log(path: Path, records: list[AuditRecord]) -> None:
    with AuditLog(path) as log:
        for r in records:
            log.write(r)


def test_the_incident_question_which_responses_could_have_been_affected(tmp_path, capsys):
    """Prompts longer than the pool that still got a 2xx; the rejected ones and the ones that fit are not."""
    path = tmp_path / "audit.jsonl"
    leaked = [record(tenant="bob", rid=rid_hex(0xB0B << 116), prompt_tokens=POOL + 1, time=T0 + 1),
              record(tenant="carol", rid=rid_hex(0xCA << 120), prompt_tokens=900_000, time=T0 + 2)]
    write_log(path, [record(prompt_tokens=POOL), *leaked, rejected(prompt_tokens=1_000_000),
                     record(prompt_tokens=POOL + 5, status=500, verification="failed: coverage: page 9")])
    assert main(["audit-log", str(path), "--min-prompt-tokens", str(POOL + 1), "--status", "2xx"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["time", "(UTC)", "tenant", "rid", "prompt", "output", "status", "decided_by",
                              "verification"]
    assert [line.split() for line in out[1:-1]] == [
        ["2026-09-21", "14:13:21", "bob", "b0b000000000", "681281", "5", "200", "-", "ok"],
        ["2026-09-21", "14:13:22", "carol", "ca0000000000", "900000", "5", "200", "-", "ok"]]
    assert out[-1] == "2 of 5 records match"
    assert main(["audit-log", str(path), "--min-prompt-tokens", str(POOL + 1), "--status", "2xx", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [msgspec.json.decode(line, type=AuditRecord) for line in out.splitlines()] == leaked
    assert err.strip() == "2 of 5 records match"


def test_cli_filters(tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    write_log(path, [record(tenant="alice", time=T0), rejected(tenant="bob", time=T0 + 3600),
                     record(tenant="carol", time=T0 + 7200, status=503, error_code="service_unavailable")])

    def tenants(*argv: str) -> list[str]:
        assert main(["audit-log", str(path), "--json", *argv]) == 0
        out = capsys.readouterr().out
        return [msgspec.json.decode(line, type=AuditRecord).tenant for line in out.splitlines()]

    assert tenants() == ["alice", "bob", "carol"]
    assert tenants("--tenant", "alice", "--tenant", "carol") == ["alice", "carol"]
    assert tenants("--since", "2026-09-21T15:00:00Z") == ["bob", "carol"]
    assert tenants("--until", str(T0 + 3600)) == ["alice", "bob"]
    assert tenants("--status", "4xx", "--status", "503") == ["bob", "carol"]
    assert tenants("--decided-by", "admission") == ["bob"]
    assert tenants("--decided-by", "none", "--status", "2xx") == ["alice"]
    with pytest.raises(SystemExit) as caught:
        main(["audit-log", str(path), "--status", "teapot"])
    assert caught.value.code == 2
