"""Automatic prefix caching on whole KV pages, scoped to the tenant. Plain Python: no torch, no clock, no IO.

A prompt's page i (its tokens ``[i * page_size, (i + 1) * page_size)``) has the 128-bit key

    key(i) = blake2b-128(scope, key(i - 1), the page's token ids),    key(-1) = 16 zero bytes
    scope  = blake2b-128(tenant, cache_salt, model id)                (each length-prefixed)

so a key names the page's tokens, every token before them, whose they are and which model computed them.
blake2b rather than a fast non-cryptographic hash: nobody can craft two prompts whose pages share a key.

Contracts:
- Only full pages are cached, and only pages this engine computed itself (never pages a remote writer filled:
  a decode worker has no prefix cache).
- A cached page is owned in the ``PageTable`` by the cache owner of its scope (``owner``: a nonzero 128-bit id
  derived from the scope), so the owner in its tags says whose cache it belongs to. The cache holds it as its
  owner; a request reading it holds a reference (``PageTable.share``). ``PageTable.check_integrity`` checks
  every cached page against ``held`` and ``owners``.
- ``match`` has no side effects; ``lend`` takes the references and refreshes the pages' recency.
- ``evict`` frees only pages no request holds (refcount 1: the cache alone), least recently used first: a page
  a request holds is never freed or reused. An evicted page goes to the back of the free queue as any freed
  page does, and the next grant of it bumps its epoch (``PageTable.grant``), so no reader holding the evicted
  entry's ``(page, epoch)`` passes L3 again.
- ``insert`` hands a request's computed pages over to the cache; the request keeps reading them by reference.
- The tenant and the salt are in every key (``scoped``): a tenant never hits, and so never times, another
  tenant's pages. ``scoped=False`` (``KVFENCE_UNSAFE=prefix_scope``, for the test that shows the harm) leaves
  them out, as vLLM does without a salt.
- Public prefixes: the first ``public_pages`` pages of a prompt that starts with a prefix an admin published
  (the router says how many tokens: ``Request.public_tokens``) are keyed under ``public_scope`` instead of the
  tenant's, and owned by its cache owner (``public_owner``, so their tags say they are public). Every tenant
  reads them; the pages after them stay in the tenant's scope, chained from the public keys. Only the router
  decides what is public: a tenant cannot key a page outside its own scope.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvfence.kvcache.pages import PageGrant, PageTable

KEY_BYTES = 16
_ROOT = bytes(KEY_BYTES)


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


class PrefixCache:
    """Cached pages of one pool, keyed by scope and content (see the module docstring)."""

    def __init__(self, pages: PageTable, page_size: int, model_id: str, scoped: bool = True) -> None:
        self.pages, self.page_size, self.model_id, self.scoped = pages, page_size, model_id, scoped
        self.entries: OrderedDict[bytes, PageGrant] = OrderedDict()  # key -> page; least recently used first
        self.held: dict[int, int] = {}  # cached page -> the cache owner holding it
        self.key_of: dict[int, bytes] = {}  # cached page -> its key
        self.owners: set[int] = set()  # every cache owner this cache has used
        self.evictions = 0  # pages evicted so far
        self.public_scope = _digest(b"public prefix", model_id.encode())  # no tenant's scope: it has 3 parts
        self.public_owner = self.owner(self.public_scope)

    # -- keys ------------------------------------------------------------------

    def scope(self, tenant: str, salt: str | None) -> bytes:
        """The digest every key of (``tenant``, ``salt``) starts from; the same for all without ``scoped``."""
        who = (tenant.encode(), b"" if salt is None else b"\x01" + salt.encode()) if self.scoped else (b"", b"")
        return _digest(*who, self.model_id.encode())

    def owner(self, scope: bytes) -> int:
        """The page-table owner of ``scope``'s cached pages: nonzero, 128 bits."""
        return int.from_bytes(_digest(b"prefix cache owner", scope), "big") or 1

    def keys(self, scope: bytes, tokens: Sequence[int], public_pages: int = 0) -> list[bytes]:
        """One key per full page of ``tokens``: the first ``public_pages`` in the public scope, the rest in
        ``scope``."""
        ids = np.asarray(tokens, dtype="<i8")
        keys, prev = [], _ROOT
        for i in range(len(ids) // self.page_size):
            page_scope = self.public_scope if i < public_pages else scope
            prev = _digest(page_scope, prev, ids[i * self.page_size : (i + 1) * self.page_size].tobytes())
            keys.append(prev)
        return keys

    def page_owners(self, scope: bytes, n: int, public_pages: int = 0) -> list[int]:
        """The cache owner of each of the first ``n`` pages keyed by ``keys(scope, ..., public_pages)``."""
        return [self.public_owner] * min(n, public_pages) + [self.owner(scope)] * max(0, n - public_pages)

    # -- queries ---------------------------------------------------------------

    def match(self, keys: Sequence[bytes]) -> list[PageGrant]:
        """The cached pages of the longest run of ``keys`` from the first."""
        hits = []
        for key in keys:
            grant = self.entries.get(key)
            if grant is None:
                break
            hits.append(grant)
        return hits

    def evictable(self, keeping: Sequence[PageGrant] = ()) -> int:
        """Cached pages no request holds, less those in ``keeping`` (pages about to be lent)."""
        kept = {g.page for g in keeping}
        return sum(1 for g in self.entries.values() if g.page not in kept and self.pages.refcount(g.page) == 1)

    # -- transitions -------------------------------------------------------------

    def lend(self, grants: Sequence[PageGrant], holder: int) -> list[int]:
        """``holder`` takes a reference to ``grants`` (a ``match``); they become the most recently used, the
        first page last, so a chain's later pages are evicted before its earlier ones. Returns each page's owner
        (whom its tags name)."""
        lenders = [self.held[g.page] for g in grants]
        for owner, grant in zip(lenders, grants, strict=True):
            self.pages.share(owner, [grant], holder)
        self._touch(grants)
        return lenders

    def insert(self, keys: Sequence[bytes], owners: Sequence[int], holder: int, grants: Sequence[PageGrant]) -> int:
        """Cache ``grants`` (pages ``holder`` owns and has computed: full, verified, no write in flight) under
        ``keys``, one each, from the first, each handed over to its entry of ``owners`` (``page_owners``); stops
        at the first key already cached (another request computed the same pages). ``holder`` keeps reading the
        pages it handed over by reference. Returns how many it cached."""
        assert len(keys) == len(owners) == len(grants)
        n = next((i for i, key in enumerate(keys) if key in self.entries), len(keys))
        for key, owner, grant in zip(keys[:n], owners[:n], grants[:n], strict=True):
            self.pages.hand_over(holder, [grant], owner)
            self.owners.add(owner)
            self.entries[key] = grant
            self.held[grant.page], self.key_of[grant.page] = owner, key
        self._touch(grants[:n])
        return n

    def evict(self, n: int) -> int:
        """Free up to ``n`` cached pages no request holds, least recently used first; returns how many."""
        victims: list[bytes] = []
        for key, grant in self.entries.items():
            if len(victims) == n:
                break
            if self.pages.refcount(grant.page) == 1:
                victims.append(key)
        for key in victims:
            grant = self.entries.pop(key)
            del self.key_of[grant.page]
            self.pages.free(self.held.pop(grant.page), [grant])
        self.evictions += len(victims)
        return len(victims)

    def _touch(self, grants: Sequence[PageGrant]) -> None:
        for grant in reversed(grants):
            self.entries.move_to_end(self.key_of[grant.page])
