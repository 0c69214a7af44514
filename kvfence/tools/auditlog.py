"""The audit log: one JSON line per request, and ``kvfence audit-log`` to ask it questions.

After an incident like the one in docs/safety.md the first question is which responses could have been affected: those
whose prompt did not fit the pool and still got a 2xx. With the incident's prefill pool of 681,280 tokens::

    kvfence audit-log audit.jsonl --min-prompt-tokens 681281 --status 2xx

``AuditLog(path).write(AuditRecord(...))`` appends a record; ``read_records`` reads them back.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

VERIFICATION_NA = "n/a"


class AuditRecord(msgspec.Struct, kw_only=True):
    """What happened to one request, written when it ended."""

    time: float  # unix seconds when the request ended
    tenant: str
    rid: str  # the 128-bit request id in hex (``rid_hex``)
    model: str
    endpoint: str  # e.g. "/v1/chat/completions"
    prompt_tokens: int
    output_tokens: int = 0
    max_tokens: int
    admission: str  # "accepted" | "rejected"
    decided_by: str | None = None  # the safety layer that rejected it, e.g. "admission"
    status: int  # the HTTP status the client got
    error_code: str | None = None  # OpenAI error code, e.g. "context_length_exceeded"
    error: str | None = None  # the error message the client got
    finish_reason: str | None = None
    prefill: str | None = None  # prefill worker id
    decode: str | None = None  # decode worker id
    decode_epoch: int = 0  # its membership epoch then (moved on each time the router fenced it)
    pages: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (page, epoch) grants it read
    verification: str = VERIFICATION_NA  # "ok", "failed: <reason>", "skipped: tags,checksum off" or "n/a"
    duration_s: float = 0.0


def rid_hex(rid: int) -> str:
    """A 128-bit request id as the 32 hex digits the log records."""
    return f"{rid:032x}"


class AuditLog:
    """Appends one JSON line per ``AuditRecord`` to ``path`` (opened for append); ``path`` None: disabled.

    Thread-safe. Each line goes to the file in one unbuffered write, so it is in the file when ``write``
    returns and lines of concurrent writers never interleave. ``write`` raises ``OSError`` if the file does.
    """

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = path
        self._file = open(path, "ab", buffering=0) if path is not None else None  # noqa: SIM115
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()

    @classmethod
    def null(cls) -> AuditLog:
        """A log that writes nothing."""
        return cls(None)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, record: AuditRecord) -> None:
        if self._file is None:
            return
        line = self._encoder.encode(record) + b"\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_records(lines: Iterable[bytes], problems: list[str]) -> Iterator[AuditRecord]:
    """The records of a log's ``lines``; each malformed line is skipped and noted in ``problems`` by number."""
    decoder = msgspec.json.Decoder(AuditRecord)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield decoder.decode(line)
        except msgspec.DecodeError as e:
            problems.append(f"line {number}: {e}")


# -- queries --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """Which records to keep: every condition given must hold (an empty one holds for all)."""

    min_prompt_tokens: int = 0
    tenants: frozenset[str] = frozenset()
    since: float | None = None
    until: float | None = None
    statuses: tuple[tuple[int, int], ...] = ()  # inclusive ranges; any may match
    decided_by: str | None = None  # a layer name; "none": not rejected by any layer

    def matches(self, r: AuditRecord) -> bool:
        return (r.prompt_tokens >= self.min_prompt_tokens
                and (not self.tenants or r.tenant in self.tenants)
                and (self.since is None or r.time >= self.since)
                and (self.until is None or r.time <= self.until)
                and (not self.statuses or any(lo <= r.status <= hi for lo, hi in self.statuses))
                and (self.decided_by is None or r.decided_by == (None if self.decided_by == "none" else
                                                                  self.decided_by)))


def parse_time(text: str) -> float:
    """Unix seconds (``"1790000000.5"``) or ISO-8601 (``"2026-10-01T12:00:00Z"``; no zone means UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad time {text!r}: want ISO-8601 or unix seconds") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def parse_status(text: str) -> tuple[int, int]:
    """``"200"`` -> (200, 200); ``"4xx"`` -> (400, 499)."""
    if re.fullmatch(r"[1-5]xx", text.lower()):
        return int(text[0]) * 100, int(text[0]) * 100 + 99
    if re.fullmatch(r"[1-5]\d\d", text):
        return int(text), int(text)
    raise argparse.ArgumentTypeError(f"bad status {text!r}: want a code like 400 or a class like 2xx")


def query_from_args(args: argparse.Namespace) -> Query:
    return Query(min_prompt_tokens=args.min_prompt_tokens, tenants=frozenset(args.tenant), since=args.since,
                 until=args.until, statuses=tuple(args.status), decided_by=args.decided_by)


# -- output ---------------------------------------------------------------------------------------------------

ROW = "{:<19}  {:<12}  {:<12}  {:>9}  {:>7}  {:>6}  {:<12}  {}"
HEADER = ROW.format("time (UTC)", "tenant", "rid", "prompt", "output", "status", "decided_by", "verification")


def table_row(r: AuditRecord) -> str:
    when = datetime.fromtimestamp(r.time, UTC).strftime("%Y-%m-%d %H:%M:%S")
    return ROW.format(when, r.tenant, r.rid[:12], r.prompt_tokens, r.output_tokens, r.status, r.decided_by or "-",
                      r.verification)


def add_audit_log_parser(sub) -> None:
    p = sub.add_parser(
        "audit-log", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="query the request audit log (JSON lines)",
        description="Print the records of an audit log (one JSON line per request) that match every filter given, "
                    "then how many matched.\n\n"
                    "Which responses could an undersized pool have affected? Those whose prompt did not fit and\n"
                    "still got a 2xx. For a pool of P tokens pass P+1: with the incident's 681,280-token prefill "
                    "pool,\n"
                    "    kvfence audit-log audit.jsonl --min-prompt-tokens 681281 --status 2xx\n"
                    "Requests a safety layer stopped:   --decided-by admission   (or --status 4xx)\n\n"
                    "Malformed lines are reported on stderr with their line number and skipped.")
    p.add_argument("file", help="the audit log (JSON lines)")
    p.add_argument("--min-prompt-tokens", type=int, default=0, metavar="N", help="prompts of at least N tokens")
    p.add_argument("--tenant", action="append", default=[], metavar="NAME", help="this tenant (repeatable)")
    p.add_argument("--since", type=parse_time, metavar="TIME", help="ended at or after (ISO-8601 or unix seconds)")
    p.add_argument("--until", type=parse_time, metavar="TIME", help="ended at or before (ISO-8601 or unix seconds)")
    p.add_argument("--status", type=parse_status, action="append", default=[], metavar="CODE",
                   help="HTTP status, e.g. 400, or a class 2xx, 4xx, 5xx (repeatable)")
    p.add_argument("--decided-by", metavar="LAYER",
                   help="rejected by this safety layer, e.g. admission; 'none': by none")
    p.add_argument("--json", action="store_true", help="print the matching records as JSON lines")
    p.set_defaults(func=cmd_audit_log)


def cmd_audit_log(args: argparse.Namespace) -> int:
    query, problems, matched, total = query_from_args(args), [], 0, 0
    encoder = msgspec.json.Encoder()
    try:
        with open(args.file, "rb") as f:
            if not args.json:
                print(HEADER)
            for record in read_records(f, problems):
                total += 1
                if query.matches(record):
                    matched += 1
                    print(encoder.encode(record).decode() if args.json else table_row(record))
    except OSError as e:
        print(f"kvfence audit-log: {e}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"kvfence audit-log: {args.file}: {problem}; skipped", file=sys.stderr)
    summary = f"{matched} of {total} records match" + (f"; {len(problems)} malformed lines skipped" if problems
                                                         else "")
    print(summary, file=sys.stderr if args.json else sys.stdout)
    return 0
