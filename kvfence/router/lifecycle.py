"""The HTTP server's stop: drain what is in flight, then hand back to the caller, which stops the engine."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from types import FrameType

import uvicorn

log = logging.getLogger("kvfence")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, saying what it drains, and not raising the signal again once it is done.

    The drain is uvicorn's: on SIGINT or SIGTERM the listeners close at once, open connections may finish their
    request for up to ``timeout_graceful_shutdown`` seconds, then their tasks are cancelled (which aborts those
    requests in the engine); a second Ctrl-C skips the wait. uvicorn then raises the signal again, which for
    SIGTERM ends the process before its workers are stopped and their KV segments removed: this server does not.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("%s: draining %d connection(s) for up to %.0fs (Ctrl-C again to stop now)",
                     signal.Signals(sig).name, len(self.server_state.connections),
                     self.config.timeout_graceful_shutdown)
        super().handle_exit(sig, frame)
