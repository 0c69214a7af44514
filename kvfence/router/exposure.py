"""Least exposure: who may learn what, and the record of every refused key.

Rules:

- ``/health`` answers only whether the server is ready (``{"status": "ok"}`` 200, or ``{"status":
  "unavailable"}`` 503) unless the request carries an admin key; then it adds the detail (mode, workers, pids,
  addresses, in-flight figures, safety switches). A tenant's or metrics reader's key gets the short answer, an
  unknown key 401. Without a tenants file there is no admin key, so no caller sees the detail.
- ``/metrics`` needs an admin or ``[metrics]`` key: 401 without a valid key, 403 with a tenant's. Without a
  tenants file (one open tenant, listening on 127.0.0.1 by default) it is open, like the API itself.
- Error bodies never carry an internal address: ``redact`` replaces ZeroMQ endpoints (``tcp://10.0.0.5:5551``)
  and IP addresses with ``<internal address>`` in every error sent to a client. Logs and the audit log keep them.
- Every 401 and 403 counts in ``kvfence_auth_failures_total{reason}`` and is logged, at most one line per client
  address per ``LOG_EVERY_S`` seconds, which says how many more were refused since the previous line. Neither
  carries key material.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from prometheus_client import Counter

from kvfence.core import AuthenticationError, KvfenceError
from kvfence.router.tenants import PermissionDenied, Tenants, bearer_key

log = logging.getLogger("kvfence.auth")
T = TypeVar("T")
LOG_EVERY_S = 60.0
ADDRESSES_KEPT = 4096  # clients whose last log line is remembered; the oldest are forgotten first
INTERNAL = "<internal address>"
_ADDRESS = re.compile(
    r"\b(?:tcp|ipc|inproc|pgm|epgm|udp|ws|wss|vmci)://[^\s,;'\"()<>]+"  # ZeroMQ endpoints
    r"|\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\](?::\d+)?"  # [IPv6]:port
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"  # IPv4[:port]
)


def redact(message: str) -> str:
    """``message`` with every internal address replaced by ``<internal address>``."""
    return _ADDRESS.sub(INTERNAL, message)


def public_body(err: KvfenceError) -> dict:
    """``err`` as the OpenAI error body a client may see."""
    body = err.to_body()
    body["error"]["message"] = redact(body["error"]["message"])
    return body


class LogThrottle:
    """At most one log line per key (a client address) per ``every_s`` seconds; remembers ``ADDRESSES_KEPT``."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()  # key -> (last line, suppressed since)

    def allow(self, key: str) -> int | None:
        """``None`` when a line for ``key`` must be suppressed now; else how many were suppressed since the last."""
        now = self.clock()
        logged_at, since = self._last.pop(key, (-math.inf, 0))
        if now - logged_at < self.every_s:
            self._last[key] = (logged_at, since + 1)
            return None
        self._last[key] = (now, 0)
        while len(self._last) > ADDRESSES_KEPT:
            self._last.popitem(last=False)
        return since


class FailedLogins:
    """Counts refused keys by reason and logs them, at most one line per client address per ``every_s``."""

    def __init__(self, counter: Counter, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.counter, self.throttle = counter, LogThrottle(every_s, clock)

    def record(self, address: str, reason: str, path: str) -> None:
        self.counter.labels(reason).inc()
        since = self.throttle.allow(address)
        if since is not None:
            more = f"; {since} more refused since the previous line" if since else ""
            log.warning("refused a key from %s on %s: %s%s", address, path, reason, more)


class Gate:
    """Every key check of the app, each refusal recorded in ``failures`` before it is raised."""

    def __init__(self, tenants: Tenants, failures: FailedLogins) -> None:
        self.tenants, self.failures = tenants, failures

    def tenant(self, http: Request) -> str:
        """The tenant of the request's key (open mode: ``default``)."""
        return self._checked(http, self.tenants.authenticate)

    def admin(self, http: Request) -> str:
        return self._checked(http, self.tenants.authenticate_admin)

    def metrics_reader(self, http: Request) -> None:
        """Pass an admin or metrics key (anyone in open mode); raise 401/403 otherwise."""
        if not self.tenants.is_open:
            self._checked(http, self.tenants.authenticate_metrics)

    def sees_detail(self, http: Request) -> bool:
        """Whether ``/health`` may show its detail: only to an admin key (so never in open mode). No bearer key, or
        one of another kind: ``False``; an unknown key: 401."""
        if self.tenants.is_open:
            return False
        if bearer_key(http.headers.get("authorization")) is None:
            return False
        kind, _ = self._checked(http, self.tenants.identify)
        return kind == "admin"

    def _checked(self, http: Request, check: Callable[[str | None], T]) -> T:
        try:
            return check(http.headers.get("authorization"))
        except (AuthenticationError, PermissionDenied) as err:
            address = http.client.host if http.client else "unknown"
            self.failures.record(address, getattr(err, "reason", "unknown_key"), http.url.path)
            raise
