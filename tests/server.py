"""Run a real ``kvfence serve`` process for end-to-end tests."""

from __future__ import annotations

import asyncio
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import openai

from kvfence.tools.soak import LocalServer

ROOT = Path(__file__).resolve().parent.parent


def wait_until(condition: Callable[[], object], timeout: float = 10, what: str = "", every: float = 0.02) -> None:
    """Poll ``condition()`` until it is true; fail naming ``what`` (or the condition) after ``timeout`` seconds.

    The tests wait on the state they need with this, never with a bare sleep: a sleep long enough on a loaded
    host is a waste on a quiet one, and a passing test after it proves nothing about what it slept for."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition.__name__}")
        time.sleep(every)


async def async_wait_until(condition: Callable[[], object], timeout: float = 10, what: str = "",
                           every: float = 0.005) -> None:
    """``wait_until`` for a test running in an event loop: it yields to the loop between polls."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition.__name__}")
        await asyncio.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TENANT_KEY, ADMIN_KEY = "sk-tester", "sk-test-admin"


class Server(LocalServer):
    """``kvfence serve ARGS`` on a free port; ``stop`` (or the context manager) ends it and its workers.

    With ``admin=True`` it serves one tenant (``TENANT_KEY``, the clients' default key) and an admin
    (``ADMIN_KEY``, which ``health`` uses, so it returns the detail).
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 120,
                 wait_ready: bool = True, admin: bool = False) -> None:
        self.key, self.admin_key = (TENANT_KEY, ADMIN_KEY) if admin else ("none", None)
        if admin:
            self.tenants_file = tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="kvfence-tenants-")
            self.tenants_file.write(f'[tenants.tester]\napi_keys = ["{TENANT_KEY}"]\n\n'
                                    f'[admin]\napi_keys = ["{ADMIN_KEY}"]\n')
            self.tenants_file.flush()
            args = (*args, "--tenants", self.tenants_file.name)
        super().__init__(list(args), env, cwd=ROOT)
        if wait_ready:
            self.wait_ready(ready_timeout)

    def health(self, key: str | None = None) -> dict:
        return super().health(key or self.admin_key)

    def log_text(self) -> str:
        """All that the server and its workers have logged so far (``output`` is its tail)."""
        return self.log_path.read_text()

    def client(self, key: str | None = None, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or self.key, max_retries=0, **kw)

    def async_client(self, key: str | None = None, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key or self.key, max_retries=0, **kw)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
