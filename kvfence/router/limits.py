"""The HTTP edge's limits, with no heavy imports (the command line builds its flags from them)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

MiB = 2**20


def default_max_request_bytes(max_context: int) -> int:
    """1 MiB plus 128 bytes per token of context: a max-context prompt fits even as ``\\uXXXX``-escaped text or as
    a token-id list (at most 7 bytes a token), with room for many messages and unknown fields."""
    return MiB + 128 * max_context


@dataclass(frozen=True)
class EdgeLimits:
    """What one request or client may take from the HTTP server. ``max_request_bytes`` ``None``: derived from the
    served context by ``default_max_request_bytes``."""

    max_request_bytes: int | None = None
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections_per_client: int = 64
    docs: bool = False

    def request_bytes(self, max_context: int) -> int:
        return self.max_request_bytes or default_max_request_bytes(max_context)


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds above 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value
