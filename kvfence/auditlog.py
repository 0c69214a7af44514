"""The audit log: one JSON line per request, written by the router; ``kvfence audit-log`` (``tools/auditlog.py``)
asks it questions.

``AuditLog(path).write(AuditRecord(...))`` appends a record; ``read_records`` reads them back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator

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
