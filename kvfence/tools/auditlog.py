"""``kvfence audit-log``: questions to the router's audit log (``kvfence/auditlog.py``).

After an incident like the one in docs/safety.md the first question is which responses could have been affected:
those whose prompt did not fit the pool and still got a 2xx. With the incident's prefill pool of 681,280 tokens::

    kvfence audit-log audit.jsonl --min-prompt-tokens 681281 --status 2xx
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

from kvfence.auditlog import AuditRecord, read_records


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
    problems: list[str] = []
    query, matched, total = query_from_args(args), 0, 0
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
