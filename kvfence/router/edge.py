"""The HTTP edge: what no request may do to the server, enforced before the OpenAI app sees it.

Two layers, each with its own contract:

- ``EdgeGuard`` (ASGI middleware, in the app):
  - routes on the path as sent: percent-escapes are decoded, except ``%2F``, ``%5C`` and ``%25`` (``/``,
    ``\\`` and ``%``), which stay escaped as data inside their segment, so ``/v1/chat%2Fcompletions`` is no
    route (404); a path parameter that may hold them is decoded once by its handler (``path_param``);
  - caps the body at ``max_request_bytes``: an app that reads the body gets ``RequestTooLarge`` (413) at its
    first read when Content-Length says more, before any byte is read, and as soon as the running count passes
    the cap otherwise (chunked bodies): at most the cap is ever held;
  - bounds the body's arrival: the whole body must come within ``body_timeout`` of the request's headers, else
    the read raises ``RequestTimeout`` (408). Reads after the body is complete (disconnect watches of streams
    that run for minutes) have no deadline.
- ``EdgeProtocol`` (uvicorn's h11 protocol, under the app):
  - a request's headers must arrive within ``header_timeout`` (from the connection's start, or from the first
    byte of a later request on a kept-alive connection; idle keep-alive is uvicorn's ``timeout_keep_alive``),
    else it answers 408 and closes;
  - a body the app does not read must still end within ``body_timeout`` (plus a grace second, so the app's
    own 408 comes first), else the connection closes (with a 408 if no response has started);
  - at most ``max_connections_per_client`` connections per client address; one more is answered 429 and
    closed;
  - closing while the client may still be sending (a 413 before the body, a refused connection) shuts our
    side first and discards what still comes for up to ``LINGER_S``, so the client reads the answer instead
    of a reset.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import anyio
import h11
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvfence.core import InvalidRequest, KvfenceError
from kvfence.router.exposure import LogThrottle
from kvfence.router.limits import EdgeLimits

LINGER_S = 2.0
BODY_GRACE_S = 1.0
_KEPT_ESCAPES = re.compile(r"(%2[fF]|%5[cC]|%25)")


class RequestTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"
    headers = {"Connection": "close"}  # the rest of the body is never read

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than this server's limit of {limit} bytes.")


class RequestTimeout(InvalidRequest):
    status = 408
    code = "request_timeout"
    headers = {"Connection": "close"}

    def __init__(self, seconds: float) -> None:
        super().__init__(f"The request body did not arrive within {seconds:g}s.")


def path_param(value: str) -> str:
    """A path parameter as the client meant it: ``EdgeGuard`` leaves ``%2F``, ``%5C`` and ``%25`` escaped."""
    return unquote(value)


def routing_path(raw_path: bytes) -> str:
    """``raw_path`` (query dropped) with every escape decoded but those of ``/``, ``\\`` and ``%`` (upper-cased)."""
    pieces = _KEPT_ESCAPES.split(raw_path.partition(b"?")[0].decode("latin-1"))
    return "".join(p.upper() if i % 2 else unquote(p) for i, p in enumerate(pieces))


class EdgeGuard:
    """ASGI middleware: routing on the path as sent, and the body's size cap and deadline (module docstring)."""

    def __init__(self, app: ASGIApp, max_request_bytes: int, body_timeout: float) -> None:
        self.app, self.max_request_bytes, self.body_timeout = app, max_request_bytes, body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("raw_path") is not None:
            scope = {**scope, "path": routing_path(scope["raw_path"])}
        await self.app(scope, self._guarded(scope, receive), send)

    def _guarded(self, scope: Scope, receive: Receive) -> Receive:
        declared = _content_length(scope)
        deadline = time.monotonic() + self.body_timeout
        received, complete = 0, False

        async def guarded_receive() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            if declared is not None and declared > self.max_request_bytes:
                raise RequestTooLarge(self.max_request_bytes)
            try:
                with anyio.fail_after(max(deadline - time.monotonic(), 0)):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(self.body_timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_request_bytes:
                    raise RequestTooLarge(self.max_request_bytes)
            return message

        return guarded_receive


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


# -- the connection ------------------------------------------------------------------------------------------


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines, a per-client connection bound and lingering close.

    Build it with ``edge_protocol(limits)``: its connections share one count per client address.
    """

    def __init__(self, *args: Any, limits: EdgeLimits, clients: Counter[str], refusals: LogThrottle,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits, self.clients, self.refusals = limits, clients, refusals
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_kind: str | None = None
        self._counted: str | None = None  # the address this connection counts against
        self._lingering = False
        self._real: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._real = transport
        self.transport = _GracefulClose(transport, self)  # type: ignore[assignment]
        host = self.client[0] if self.client else None
        if host is not None:
            self._counted = host
            self.clients[host] += 1
            if self.clients[host] > self.limits.max_connections_per_client:
                self._refuse()
                return
        self._arm("headers", self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted is not None:
            self.clients[self._counted] -= 1
            if not self.clients[self._counted]:
                del self.clients[self._counted]
            self._counted = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # our answer is sent: what still comes is dropped, never buffered
        super().data_received(data)

    def eof_received(self) -> None:
        if self._lingering:
            self._close_now()
        super().eof_received()

    def handle_events(self) -> None:
        super().handle_events()
        self._track_reads()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_reads()

    # -- deadlines ---------------------------------------------------------------------------------------

    def _track_reads(self) -> None:
        """Keep the one deadline that fits what the client owes us now."""
        if self._lingering or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm("body", self.limits.body_timeout + BODY_GRACE_S)
        elif state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            self._arm("headers", self.limits.header_timeout)  # a first request, or a later one begun
        else:
            self._disarm()  # the request is in, or an idle keep-alive (uvicorn's own timeout)

    def _arm(self, kind: str, seconds: float) -> None:
        if self._deadline_kind == kind:
            return
        self._disarm()
        self._deadline_kind = kind
        self._deadline = self.loop.call_later(seconds, self._expired, kind)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_kind = None, None

    def _expired(self, kind: str) -> None:
        self._deadline, self._deadline_kind = None, None
        if self.transport.is_closing():
            return
        cycle = self.cycle if kind == "body" else None
        if cycle is not None and cycle.response_started:
            self._close_now()
            return
        if cycle is not None:  # the app is silenced: its later sends are dropped
            cycle.disconnected = True
            cycle.message_event.set()
        what = "request headers" if kind == "headers" else "request body"
        seconds = self.limits.header_timeout if kind == "headers" else self.limits.body_timeout
        self._answer_and_close(408, f"The {what} did not arrive within {seconds:g}s.", "request_timeout", linger=False)

    # -- refusing and closing -----------------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (or headers over its 16 KiB): 400 in OpenAI's shape, then close."""
        self._warn("invalid HTTP request")
        self._answer_and_close(400, "The request is not valid HTTP/1.1, or its headers are too large.",
                               "invalid_http_request", linger=False)

    def _unsupported_upgrade_warning(self) -> None:
        self._warn("unsupported upgrade request (served as plain HTTP)")

    def _refuse(self) -> None:
        self._warn(f"refused a connection: over {self.limits.max_connections_per_client} from one address")
        self._answer_and_close(429, f"Too many connections from your address (at most "
                                    f"{self.limits.max_connections_per_client}).", "too_many_connections", linger=True)

    def _warn(self, what: str) -> None:
        """Log ``what`` for this client, at most one line per address and minute."""
        host = self.client[0] if self.client else "unknown"
        since = self.refusals.allow(f"{host} {what}")
        if since is not None:
            more = f" ({since} more since the previous line)" if since else ""
            self.logger.warning("%s from %s%s", what, host, more)

    def _answer_and_close(self, status: int, message: str, code: str, linger: bool) -> None:
        """Send a complete error response outside h11 (no request is being answered through it) and close."""
        self.transport.write(raw_error_response(status, message, code))
        self._disarm()
        if linger:
            self._linger()
        else:
            self._close_now()

    def close_gracefully(self) -> None:
        """Close, lingering if the client is still sending a body we will not read."""
        if self.conn.their_state is h11.SEND_BODY:
            self._linger()
        else:
            self._close_now()

    def _linger(self) -> None:
        """Shut our side (the client reads our answer, not a reset), drop what still comes, close later."""
        assert self._real is not None
        if self._real.is_closing() or self._lingering:
            return
        if not self._real.can_write_eof():
            self._close_now()
            return
        self._lingering = True
        self._disarm()
        self._real.write_eof()
        self._real.resume_reading()
        self.loop.call_later(LINGER_S, self._close_now)

    def _close_now(self) -> None:
        if self._real is not None:
            self._real.close()


class _GracefulClose:
    """The transport as uvicorn's request cycle sees it: ``close`` lingers (``EdgeProtocol.close_gracefully``)."""

    def __init__(self, real: asyncio.Transport, protocol: EdgeProtocol) -> None:
        self.real, self._protocol = real, protocol

    def close(self) -> None:
        self._protocol.close_gracefully()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def raw_error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI error body; the connection closes after it."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    reason = HTTPStatus(status).phrase
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


def edge_protocol(limits: EdgeLimits) -> Callable[..., EdgeProtocol]:
    """The protocol factory for ``uvicorn.Config(http=...)``: one shared count of connections per address."""
    return partial(EdgeProtocol, limits=limits, clients=Counter(), refusals=LogThrottle())


def uvicorn_config(app: ASGIApp, limits: EdgeLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` behind ``EdgeProtocol``; ``kwargs`` go to ``uvicorn.Config``."""
    kwargs.setdefault("log_level", "warning")
    # No WebSocket: the API has none, and an upgraded connection would leave its address's count for good.
    return uvicorn.Config(app, http=edge_protocol(limits), ws="none", **kwargs)  # type: ignore[arg-type]


def error_headers(err: KvfenceError) -> dict[str, str] | None:
    """Extra response headers an error needs (``Connection: close`` when the body was left unread)."""
    return getattr(err, "headers", None)
