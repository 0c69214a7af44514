"""Page bookkeeping for one KV pool: owners, epochs, fill counts, states.

Plain Python and NumPy, no torch, so it can be tested and model-checked
alone. The storage itself lives in ``pool.py`` and is never scrubbed: a page's
bytes belong to whoever wrote them last, and only this table says whose they
are now.

Contracts:
- ``grant`` hands out pages in free-queue order (FIFO: the page freed longest
  ago goes first) and bumps each page's epoch; a grant is ``(page, epoch)``.
- Only the owner may free or quarantine a page, and only under the epoch it
  was granted with; anything else raises ``PageError``. A double free raises.
- A quarantined page is never granted again until ``release_quarantine``.
- Sharing (n > 1 choices): ``share`` lets another request hold a page by reference, read-only. A page's owner
  and epoch never change while it is held; its holders are the owner and every sharer until each frees it, and
  the page returns to the free queue only when its last holder frees it. A shared page cannot be quarantined,
  and ``check_writable`` refuses any page with more than one holder.
- Handing over (prefix caching): ``hand_over`` makes another id (a prefix cache's) the owner of pages, whose
  first owner keeps a reference; the epoch does not change. A page a prefix cache holds is freed only by the
  cache (``kvcache/prefix.py``: never while another holder reads it).
- ``check_integrity`` holds whenever no call is in progress.

``all_held`` is L3's fast path: one call into ``tag_check.c`` per decode step; where it says no (or is not
built), callers check with ``verify``, which also says which pages fail.
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from types import ModuleType

import numpy as np

from kvfence import env

_MASK64 = (1 << 64) - 1


class PageState(IntEnum):
    FREE = 0
    GRANTED = 1  # owned; nothing written yet
    WRITING = 2  # a transfer into it may be in flight
    READY = 3  # written and verified; decode may read it
    QUARANTINED = 4  # a write may still land; never reused until released


_HELD = np.array([PageState.GRANTED <= s <= PageState.READY for s in range(max(PageState) + 1)])  # by state


@dataclass(frozen=True)
class PageGrant:
    page: int
    epoch: int


class PageError(RuntimeError):
    """A page operation broke the ownership rules (a bug, never user input)."""


class OutOfPages(RuntimeError):
    """Not enough free pages for a grant; callers check ``can_grant`` first."""


@functools.cache
def _tag_check() -> ModuleType | None:
    """``tag_check.c`` built as a Python module, or None where it cannot be built or ``KVFENCE_TAG_CHECK_C=0``."""
    if not env.tag_check_c():
        return None
    from kvfence.cbuild import load_extension

    return load_extension(Path(__file__).with_name("tag_check.c"), "_kvf_tag_check")


def _split(owner: int) -> tuple[int, int]:
    return owner >> 64, owner & _MASK64


class PageTable:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.owner_hi = np.zeros(num_pages, dtype=np.uint64)
        self.owner_lo = np.zeros(num_pages, dtype=np.uint64)
        self.epoch = np.zeros(num_pages, dtype=np.uint64)
        self.filled = np.zeros(num_pages, dtype=np.int32)
        self.state = np.full(num_pages, PageState.FREE, dtype=np.uint8)
        self.quarantine_reason: dict[int, str] = {}
        self.holders: dict[int, set[int]] = {}  # shared pages only: who holds a reference (the owner may have left)
        self._free: deque[int] = deque(range(num_pages))

    # -- queries -----------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        return len(self.quarantine_reason)

    def quarantine_reasons(self) -> dict[str, int]:
        """Reason -> how many pages are quarantined for it."""
        return dict(Counter(self.quarantine_reason.values()))

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free - self.num_quarantined

    def can_grant(self, n: int) -> bool:
        return n <= len(self._free)

    def owner_of(self, page: int) -> int:
        return (int(self.owner_hi[page]) << 64) | int(self.owner_lo[page])

    def refcount(self, page: int) -> int:
        """How many requests hold ``page``: 0 when it is free or quarantined."""
        if page in self.holders:
            return len(self.holders[page])
        return int(_HELD[self.state[page]])

    def holds(self, holder: int, grant: PageGrant) -> bool:
        """Whether ``holder`` holds ``grant``'s page under its epoch, as its owner or by a reference."""
        page = grant.page
        if not (0 <= page < self.num_pages and _HELD[self.state[page]] and int(self.epoch[page]) == grant.epoch):
            return False
        shared = self.holders.get(page)
        return holder in shared if shared is not None else self.owner_of(page) == holder

    def held_by(self, holder: int, pages: np.ndarray, epochs: np.ndarray) -> bool:
        """L3 for a reader of shared pages: ``holder`` holds every one of ``pages`` under ``epochs``."""
        return all(self.holds(holder, PageGrant(int(p), int(e))) for p, e in zip(pages, epochs, strict=True))

    def check_writable(self, pages: list[int]) -> None:
        """Raise ``PageError`` if any of ``pages`` has more than one holder: a write would reach another reader."""
        for page in pages:
            if len(self.holders.get(page, ())) > 1:
                raise PageError(f"page {page} is shared by {len(self.holders[page])} requests; it is read-only")

    # -- transitions ---------------------------------------------------------

    def grant(self, owner: int, n: int) -> list[PageGrant]:
        """Give ``n`` free pages to ``owner``; each gets a fresh epoch."""
        if owner == 0:
            raise PageError("owner 0 means 'no owner' and cannot hold pages")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        hi, lo = _split(owner)
        grants = []
        for _ in range(n):
            page = self._free.popleft()
            self.epoch[page] += 1
            self.owner_hi[page], self.owner_lo[page] = hi, lo
            self.filled[page] = 0
            self.state[page] = PageState.GRANTED
            grants.append(PageGrant(page, int(self.epoch[page])))
        return grants

    def set_state(self, owner: int, grants: list[PageGrant], state: PageState) -> None:
        """Move owned pages to GRANTED, WRITING or READY."""
        if state in (PageState.FREE, PageState.QUARANTINED):
            raise PageError("use free() or quarantine()")
        for g in grants:
            self._check_owned(owner, g)
            self.state[g.page] = state

    def set_filled(self, owner: int, grant: PageGrant, tokens: int) -> None:
        self._check_owned(owner, grant)
        self.filled[grant.page] = tokens

    def share(self, holder: int, grants: list[PageGrant], sharer: int) -> None:
        """``sharer`` takes a reference to pages ``holder`` holds, none of them WRITING (a transfer may still land)."""
        for g in grants:
            if not self.holds(holder, g) or self.state[g.page] == PageState.WRITING:
                raise PageError(f"page {g.page} epoch {g.epoch} is not held by {holder:032x}, or is being written")
            if self.holds(sharer, g):
                raise PageError(f"page {g.page} is already held by {sharer:032x}")
        for g in grants:
            self.holders.setdefault(g.page, {self.owner_of(g.page)}).add(sharer)

    def hand_over(self, owner: int, grants: list[PageGrant], new_owner: int) -> None:
        """``new_owner`` (a prefix cache) becomes the owner of ``owner``'s unshared pages, none of them WRITING;
        ``owner`` keeps a reference. Epochs stay: the bytes are the ones ``owner`` computed."""
        for g in grants:
            self._check_owned(owner, g)
            if g.page in self.holders or self.state[g.page] == PageState.WRITING:
                raise PageError(f"page {g.page} is shared or being written; only a computed page of one holder "
                                "can be handed over")
        hi, lo = _split(new_owner)
        for g in grants:
            self.owner_hi[g.page], self.owner_lo[g.page] = hi, lo
            self.holders[g.page] = {new_owner, owner}

    def free(self, holder: int, grants: list[PageGrant]) -> None:
        """Drop ``holder``'s hold on pages; a page whose last holder leaves goes to the back of the free queue.
        Raises on a page not held by ``holder``."""
        for g in grants:
            if not self.holds(holder, g):
                self._check_owned(holder, g)  # raises, naming why
                raise PageError(f"page {g.page}: {holder:032x} already released its reference")
        for g in grants:
            if self._release_reference(holder, g.page):
                continue
            self._clear(g.page)
            self.state[g.page] = PageState.FREE
            self._free.append(g.page)

    def quarantine(self, owner: int, grants: list[PageGrant], reason: str) -> None:
        """Take pages out of circulation: a write into them may still land. A shared page cannot be."""
        for g in grants:
            self._check_owned(owner, g)
            if g.page in self.holders:
                raise PageError(f"page {g.page} is shared; only an unshared page can be quarantined")
        for g in grants:
            self._clear(g.page)
            self.state[g.page] = PageState.QUARANTINED
            self.quarantine_reason[g.page] = reason

    def release_quarantine(self, page: int) -> None:
        """The writer is known finished or gone: the page may be granted again."""
        if self.state[page] != PageState.QUARANTINED:
            raise PageError(f"page {page} is not quarantined")
        del self.quarantine_reason[page]
        self.state[page] = PageState.FREE
        self._free.append(page)

    # -- verification --------------------------------------------------------

    def all_held(self, seq_tags: list[tuple[np.ndarray, ...]], tag_records: np.ndarray | None) -> bool:
        """True only if every page of ``seq_tags`` (``verify``'s arguments, one 4-tuple per sequence) passes
        ``verify`` and, given the pool's ``tag_records``, its record names that owner, epoch and page; checked in
        one C call. False when some page fails or ``tag_check.c`` is not built: check with ``verify`` then."""
        check = _tag_check()
        return check is not None and check.all_held(self.owner_hi, self.owner_lo, self.epoch, self.state,
                                                     PageState.GRANTED, PageState.READY, seq_tags, tag_records)

    def verify(self, pages: np.ndarray, owner_hi: np.ndarray, owner_lo: np.ndarray, epochs: np.ndarray) -> np.ndarray:
        """Vectorised tag check: a bool per page, True where owner and epoch match and the page is held."""
        ok: np.ndarray = self.owner_hi[pages] == owner_hi
        ok &= self.owner_lo[pages] == owner_lo
        ok &= self.epoch[pages] == epochs
        ok &= _HELD[self.state[pages]]
        return ok

    def check_integrity(self, cached: Mapping[int, int] | None = None, cache_owners: Collection[int] = ()) -> None:
        """Raise ``PageError`` unless every page is in exactly one consistent place.

        ``cached`` (page -> owner) names the pages a prefix cache holds, ``cache_owners`` the ids it owns pages
        under: each cached page must be held by that owner, and no other page may be owned by a cache owner."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise PageError("a page is in the free queue twice")
        states = self.state
        n_free = int((states == PageState.FREE).sum())
        n_quarantined = int((states == PageState.QUARANTINED).sum())
        held = (states >= PageState.GRANTED) & (states <= PageState.READY)
        n_held = int(held.sum())
        if n_free != len(free) or any(states[p] != PageState.FREE for p in free):
            raise PageError("free queue and page states disagree")
        if n_quarantined != len(self.quarantine_reason):
            raise PageError("quarantined pages without a recorded reason")
        if n_free + n_held + n_quarantined != self.num_pages:
            raise PageError("free + held + quarantined != total")
        unowned = (self.owner_hi == 0) & (self.owner_lo == 0)
        if np.any(unowned & held):
            raise PageError("a held page has no owner")
        if any(not held[p] or not h for p, h in self.holders.items()):
            raise PageError("a shared page is not held, or has no holder")
        self._check_cached(held, cached or {}, cache_owners)

    def _check_cached(self, held: np.ndarray, cached: Mapping[int, int], cache_owners: Collection[int]) -> None:
        for page, owner in cached.items():
            if not held[page] or self.owner_of(page) != owner or owner not in self.holders.get(page, {owner}):
                raise PageError(f"cached page {page} is not held by its cache")
        owners = set(cache_owners)
        if owners and any(self.owner_of(p) in owners for p in np.flatnonzero(held).tolist() if p not in cached):
            raise PageError("a page is owned by a prefix cache that does not hold it")

    # -- internals -----------------------------------------------------------

    def _check_owned(self, owner: int, grant: PageGrant) -> None:
        page = grant.page
        if not 0 <= page < self.num_pages:
            raise PageError(f"page {page} out of range")
        state = PageState(self.state[page])
        if state in (PageState.FREE, PageState.QUARANTINED):
            raise PageError(f"page {page} is {state.name.lower()}, not held (double free?)")
        if self.owner_of(page) != owner or int(self.epoch[page]) != grant.epoch:
            raise PageError(f"page {page} epoch {grant.epoch} is not held by {owner:032x}")

    def _release_reference(self, holder: int, page: int) -> bool:
        """Drop ``holder`` from a shared page; True while others still hold it (the page stays as it is)."""
        shared = self.holders.get(page)
        if shared is None:
            return False
        shared.discard(holder)
        if len(shared) > 1 or (shared and shared != {self.owner_of(page)}):
            return True
        del self.holders[page]  # back to its owner alone, or to nobody
        return bool(shared)

    def _clear(self, page: int) -> None:
        self.owner_hi[page] = self.owner_lo[page] = 0
        self.filled[page] = 0
