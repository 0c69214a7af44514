"""Prefixes an admin published (say, the deployment's system prompt): cached once, read by every tenant.

A request whose prompt starts with a published prefix, token for token, carries that prefix's length to the
prefill worker as ``Request.public_tokens``; its cache keys those pages in the public scope
(``kvcache/prefix.py``), so every tenant's request with the prefix reads the same pages. Everything after the
prefix stays in the tenant's own scope.

Contracts:
- Only the admin API publishes or withdraws a prefix. A tenant's request is never public past a published
  prefix's last token, so no tenant can make its own pages readable by another.
- At most ``MAX_PREFIXES`` are published, each of at least one token; publishing the same tokens again returns
  the existing entry.
- Withdrawing a prefix makes later requests key those pages in their tenant's scope again; the public pages
  already cached are never hit again and age out of the cache (LRU).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvfence.core import InvalidRequest

MAX_PREFIXES = 64


@dataclass(frozen=True)
class PublicPrefix:
    id: str
    tokens: tuple[int, ...]
    created: int  # Unix seconds
    admin: str  # who published it

    def describe(self) -> dict:
        return {"id": self.id, "object": "prefix", "tokens": len(self.tokens), "created": self.created,
                "published_by": self.admin}


class PublicPrefixes:
    """The published prefixes of one deployment, by id."""

    def __init__(self) -> None:
        self._by_id: dict[str, PublicPrefix] = {}

    def __iter__(self):
        return iter(self._by_id.values())

    def publish(self, tokens: Sequence[int], admin: str) -> PublicPrefix:
        tokens = tuple(tokens)
        if not tokens:
            raise InvalidRequest("The prefix is empty.", param="prompt")
        for prefix in self._by_id.values():
            if prefix.tokens == tokens:
                return prefix
        if len(self._by_id) >= MAX_PREFIXES:
            raise InvalidRequest(f"At most {MAX_PREFIXES} prefixes can be published; withdraw one first.",
                                 param="prompt")
        prefix = PublicPrefix(f"prefix-{secrets.token_hex(8)}", tokens, int(time.time()), admin)
        self._by_id[prefix.id] = prefix
        return prefix

    def withdraw(self, prefix_id: str) -> PublicPrefix:
        """Remove a prefix; ``KeyError`` if there is none by that id."""
        return self._by_id.pop(prefix_id)

    def match(self, prompt_ids: Sequence[int]) -> int:
        """How many of ``prompt_ids``' first tokens are public: the longest published prefix it starts with."""
        best = 0
        for prefix in self._by_id.values():
            n = len(prefix.tokens)
            if best < n <= len(prompt_ids) and tuple(prompt_ids[:n]) == prefix.tokens:
                best = n
        return best
