"""Where each generation request's end goes, exactly once: its log line, the metrics, and the audit log.

A ``RequestEnd`` is filled in as the request runs; ``Ledger.record`` is called once when it ends, by the
rejection path of ``OpenAIServer.serve`` or by ``Generation.close``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from kvfence.auditlog import VERIFICATION_NA, AuditLog, AuditRecord, rid_hex
from kvfence.core import KvfenceError, RequestOutput
from kvfence.router.admin import LOCAL_WORKER, ManagedEngine, Route
from kvfence.router.metrics import VERIFICATION_LAYERS, Metrics

log = logging.getLogger("kvfence.router")
COLOCATED_VERIFICATION = "n/a (colocated)"  # no KV lands in colocated mode: nothing to verify


@dataclass(frozen=True)
class RequestEnd:
    """What is known of a request when it ends. ``last`` is the engine's last output, if any came."""

    tenant: str
    rid: int
    model: str
    endpoint: str
    arrived: float  # time.monotonic() at arrival
    prompt_tokens: int
    max_tokens: int  # as admission settles it
    status: int = 500
    error: KvfenceError | None = None
    output_tokens: int = 0
    last: RequestOutput | None = None

    def rejected(self, err: KvfenceError) -> RequestEnd:
        return replace(self, status=err.status, error=err)

    @property
    def admission(self) -> str:
        """"rejected" when the request failed before the engine produced any output, else "accepted"."""
        return "rejected" if self.error is not None and self.last is None else "accepted"


class Ledger:
    def __init__(self, engine: ManagedEngine, metrics: Metrics, audit: AuditLog) -> None:
        self.engine, self.metrics, self.audit = engine, metrics, audit

    def record(self, end: RequestEnd) -> None:
        """Log, count and audit ``end``. An audit log that cannot be written is logged, not raised."""
        log.info("request tenant=%s rid=%032x prompt_tokens=%d completion_tokens=%d status=%d",
                 end.tenant, end.rid, end.prompt_tokens, end.output_tokens, end.status)
        preemptions = end.last.preemptions if end.last is not None else 0
        self.metrics.request_ended(end.tenant, end.status, end.error, end.output_tokens, preemptions,
                                   end.prompt_tokens if end.last is not None else 0, time.monotonic() - end.arrived)
        try:
            self.audit.write(self.audit_record(end))
        except OSError:
            log.exception("could not write the audit record of rid=%032x", end.rid)

    def audit_record(self, end: RequestEnd) -> AuditRecord:
        """``prefill``/``decode``: where the engine sent it (none if it never reached a worker); ``pages`` and
        ``verification``: from the last output, else a verification layer's error, else "n/a (colocated)" or
        "n/a"."""
        err, last = end.error, end.last
        route = self.engine.route(end.rid)
        prefill, decode, epoch = route or (None, None, 0)
        return AuditRecord(
            time=time.time(), tenant=end.tenant, rid=rid_hex(end.rid), model=end.model, endpoint=end.endpoint,
            prompt_tokens=end.prompt_tokens, output_tokens=end.output_tokens, max_tokens=end.max_tokens,
            admission=end.admission, decided_by=err.layer if err else None, status=end.status,
            error_code=(err.code or err.type) if err else None, error=err.message if err else None,
            finish_reason=str(last.finish_reason) if last and last.finish_reason else None,
            prefill=prefill, decode=decode, decode_epoch=epoch, pages=list(last.pages or []) if last else [],
            verification=_verification(err, last, route), duration_s=time.monotonic() - end.arrived)


def _verification(err: KvfenceError | None, last: RequestOutput | None, route: Route | None) -> str:
    if last is not None and last.verification:
        return last.verification
    if err is not None and err.layer in VERIFICATION_LAYERS:
        return f"failed: {err.message}"
    return COLOCATED_VERIFICATION if route is not None and route.decode == LOCAL_WORKER else VERIFICATION_NA
