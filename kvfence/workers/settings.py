"""``WorkerSettings``: what a worker process needs to start. Torch-free, so the supervisor (in the router's
process) can build and pickle them without importing the worker code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker process needs to start (picklable: it crosses the process spawn)."""

    role: str  # "prefill" | "decode"
    bind: str  # ZeroMQ address to bind the inbox to (its id unless ``advertise`` is set)
    router: str  # the router's inbox address
    model: str
    dtype: str
    device: str
    max_context: int
    pool_tokens: int
    page_size: int = 16
    chunk_size: int = 512
    step_tokens: int = 512
    max_batch: int = 64
    transfer: str = "shm"
    advertise: str | None = None
    emulate_incident: bool = False
    threads: int = 0  # CPU threads (0: torch's default)
    solo_threads: int = 0  # threads when the other role idles (decode: no prefill pending; prefill: idle_pair)
    log_level: str = "INFO"
    handoff_timeout: float = 30.0  # each handoff step (decode: pages, then Done; prefill: Dest) may take this long
