"""Run a real ``kvfence serve`` process for end-to-end tests."""

from __future__ import annotations

import socket
from pathlib import Path

import openai

from kvfence.tools.soak import LocalServer

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server(LocalServer):
    """``kvfence serve ARGS`` on a free port; ``stop`` (or the context manager) ends it and its workers."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 120,
                 wait_ready: bool = True) -> None:
        super().__init__(list(args), env, cwd=ROOT)
        if wait_ready:
            self.wait_ready(ready_timeout)

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def async_client(self, key: str = "none", **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
