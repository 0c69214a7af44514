"""Continuous batching over a paged KV pool, with a weighted fair share of tokens across tenants.

Every step, each running request past its prompt decodes one token, and
prompts advance by whole chunks within a token budget. Requests join and leave
the batch every step.

Contracts:
- A prompt's chunk boundaries are fixed multiples of ``chunk_size`` counted
  from its first token, whatever else is scheduled, so its computation (and
  greedy output) never depends on its neighbours.
- Fair order (``FairShares``, the router queue's virtual token counters, kept
  per scheduler): every token computed is charged to its tenant, divided by
  the request's ``weight``. Prompt chunks and admissions go to the tenant with
  the smallest counter first, oldest request first within a tenant. The head
  in that order is never overtaken: a request that does not fit yet waits.
- A request is admitted only when pages for its whole prompt can be granted;
  decode grows one page at a time. When the pool runs dry, the running tenant
  furthest over its share (the highest counter: the most tokens served for
  its weight) loses its newest running request: its pages are freed and it
  recomputes later, replaying its generated tokens one decode step at a time
  so that its KV comes out bit-identical. A tenant served less is never
  preempted while one served more runs. Only requests the engine owns are
  preempted: every write into their pages has landed (decode hands pages to
  the engine only after ``Done``), so a freed page can take no late write
  (L6).
- Prefix caching (``cache``): admission first looks the prompt's full pages up in the prefix cache and
  borrows the longest run it finds, but never more than leaves the last two prompt tokens to compute
  (``hit_pages``); pages no request holds are evicted, least recently used first, before anything is
  preempted or a request waits for pages. Chunks of the rest keep their fixed boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvfence.config import EngineConfig
from kvfence.core import Request
from kvfence.kvcache.pages import PageGrant, PageTable
from kvfence.kvcache.prefix import PrefixCache
from kvfence.protocol.capacity import FairShares

if TYPE_CHECKING:  # the bookkeeping runs without torch (``kvfence verify --cache`` drives it)
    import torch


@dataclass(eq=False)
class Sequence:
    """A request's (or one choice's) engine-side state: its pages and how far its KV is computed.

    It may read its first ``shared`` grants by reference, each owned by its entry of ``lenders`` (their tags name
    it): a forked choice's prompt pages (owned by choice 0 or a prefix cache), prefix-cache pages it hit, or
    pages it computed and handed over to the prefix cache.
    """

    req: Request
    generator: torch.Generator | None = None
    index: int = 0  # which choice of its request
    group: Group | None = None  # the request's choices, when it has several
    grants: list[PageGrant] = field(default_factory=list)
    lenders: list[int] = field(default_factory=list)  # the owner of each of the first grants, read by reference
    num_computed: int = 0  # positions whose K/V are in the pool
    cached: int = 0  # prompt tokens served from the prefix cache at its latest admission
    tags: tuple[np.ndarray, ...] = ()  # (pages, owner_hi, owner_lo, epochs) for PageTable.verify
    stamped: int = 0  # grants whose tag records already name this request (decode with remote writers)
    arrival: int = 0  # its place in the scheduler's arrival order
    preemptions: int = 0  # times it was preempted

    @property
    def rid(self) -> int:
        return self.req.rid

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_len + len(self.req.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.req.prompt_len

    @property
    def page_ids(self) -> list[int]:
        return [g.page for g in self.grants]

    @property
    def shared(self) -> int:
        return len(self.lenders)

    @property
    def owners(self) -> list[int]:
        """Whom the tags of each grant name."""
        return self.lenders + [self.rid] * (len(self.grants) - self.shared)

    def add_grants(self, grants: list[PageGrant]) -> None:
        self.grants += grants
        owners = np.array(self.owners, dtype=object)
        self.tags = (
            np.array(self.page_ids, dtype=np.int64),
            (owners >> 64).astype(np.uint64),
            (owners & (2**64 - 1)).astype(np.uint64),
            np.array([g.epoch for g in self.grants], dtype=np.uint64),
        )

    def borrow(self, lenders: list[int], grants: list[PageGrant]) -> None:
        """Read ``grants`` (pages shared with this sequence, each owned by its entry of ``lenders``) as its first
        pages."""
        assert not self.grants, "a sequence borrows its prompt's pages before it holds any"
        self.lenders = list(lenders)
        self.add_grants(grants)

    def hand_over(self, owners: list[int]) -> None:
        """Its next own grants now belong to ``owners``, one each (``PageTable.hand_over``); it reads them by
        reference."""
        self.lenders += owners
        self.add_grants([])

    def drop_grants(self) -> list[PageGrant]:
        grants, self.grants, self.tags, self.lenders = self.grants, [], (), []
        self.num_computed = self.stamped = 0
        return grants


@dataclass(eq=False)
class Group:
    """The ``n`` choices of one request: choice 0 computes the prompt, the others fork from it at the first token.

    ``trackers`` hold each choice's output state until it forks; ``open`` counts choices not yet ended.
    """

    rid: int
    branches: list[Sequence]
    trackers: list  # [OutputTracker], one per choice
    open: int
    forked: bool = False
    tokens: int = 0  # completion tokens of every choice so far
    pages: list[tuple[int, int]] = field(default_factory=list)  # grants read by the choices that ended
    preemptions: int = 0


@dataclass(frozen=True)
class Work:
    """Compute positions [start, end) of ``seq`` this step."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """True when this work yields the sequence's next new token."""
        return self.end == self.seq.num_tokens

    def pages_written(self, page_size: int) -> list[int]:
        """The pages whose slots this work's K/V lands in (positions [start, end) of ``seq``)."""
        return self.seq.page_ids[self.start // page_size : (self.end - 1) // page_size + 1]


class Scheduler:
    def __init__(self, config: EngineConfig, pages: PageTable, cache: PrefixCache | None = None) -> None:
        self.config = config
        self.pages = pages
        self.cache = cache
        self.waiting: list[Sequence] = []  # taken in fair order (``_key``)
        self.running: list[Sequence] = []  # in admission order
        self.shares = FairShares(config.fair)
        self.arrivals = 0
        self.num_preempted = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self._arrive(seq)
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Take ``seq`` straight into the batch (its prompt's KV is already in its pages; its tenant pays for it)."""
        self._arrive(seq)
        self.shares.start(seq.req.tenant, seq.req.prompt_len, seq.req.weight)
        self.running.append(seq)

    def add_branch(self, seq: Sequence) -> None:
        """Take a forked choice into the batch: its prompt's KV is shared, nobody pays for it again."""
        self._arrive(seq)
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its pages."""
        self.detach(seq)
        self.pages.free(seq.rid, seq.drop_grants())

    def detach(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues, keeping its pages: its caller frees (or quarantines) them later."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> list[Work]:
        """This step's work: a decode row for every running request past its prompt, then prompt chunks and
        admissions in fair order within the token budget. The first waiting request that does not fit stops
        admission for this step (it is never overtaken); prompts already running go on."""
        work = self._schedule_decodes()
        budget, admitting = self.config.step_tokens, True
        for seq in sorted([s for s in self.running if s.in_prefill] + self.waiting, key=self._key):
            if budget <= 0:
                break
            if seq in self.waiting:
                admitting = admitting and self._admit(seq)
                if not admitting:
                    continue
            budget = self._add_chunk(seq, work, budget)
        return work

    def _arrive(self, seq: Sequence) -> None:
        tenant = seq.req.tenant
        if not any(s.req.tenant == tenant for s in (*self.waiting, *self.running)):
            self.shares.resume(tenant)  # back after idling: no credit for the idle time
        self.arrivals += 1
        seq.arrival = self.arrivals

    def _key(self, seq: Sequence) -> tuple[float, int]:
        return self.shares.counter(seq.req.tenant), seq.arrival

    def _schedule_decodes(self) -> list[Work]:
        grown = [seq for seq in list(self.running) if seq in self.running and not seq.in_prefill and self._grow(seq)]
        work = [Work(seq, seq.num_computed, seq.num_computed + 1)
                for seq in grown if seq in self.running]  # a later growth may have preempted an earlier one
        for w in work:
            self.shares.charge(w.seq.req.tenant, 1, w.seq.req.weight)
        return work

    def _grow(self, seq: Sequence) -> bool:
        """Make sure ``seq`` has a page for its next position, preempting by share if needed.

        Returns False when ``seq`` itself had to be preempted.
        """
        if self.config.pages_for(seq.num_computed + 1) <= len(seq.grants):
            return True
        while not self.make_room(1):
            victim = self._victim()
            self._preempt(victim)
            if victim is seq:
                return False
        seq.add_grants(self.pages.grant(seq.rid, 1))
        return True

    def _victim(self) -> Sequence:
        """The newest running request of the tenant furthest over its share: the highest counter (on a tie, the
        tenant of the newest request)."""
        return max(self.running[::-1], key=lambda s: self.shares.counter(s.req.tenant))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pages.free(seq.rid, seq.drop_grants())
        self.waiting.append(seq)
        seq.preemptions += 1
        self.num_preempted += 1

    def _add_chunk(self, seq: Sequence, work: list[Work], budget: int) -> int:
        chunk = self.config.chunk_size
        start = seq.num_computed
        end = min(seq.req.prompt_len, (start // chunk + 1) * chunk)
        if end - start > budget and budget < self.config.step_tokens:
            return 0  # out of budget; the step's first chunk always runs, so no prompt starves
        work.append(Work(seq, start, end))
        self.shares.start(seq.req.tenant, end - start, seq.req.weight)
        return budget - (end - start)

    def make_room(self, n: int) -> bool:
        """Whether ``n`` pages can be granted, evicting prefix-cache pages no request holds if need be."""
        short = n - self.pages.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.pages.can_grant(n)

    def hit_pages(self, prompt_len: int) -> int:
        """The most prompt pages a request may read from the prefix cache: whole pages that leave at least two
        tokens to compute. The last token must run (its logits give the first token), and a one-token chunk
        would take the decode rows' arithmetic: with two or more, every computed row gets the arithmetic it
        gets without the cache, so a hit changes no bit of the KV or of the logits."""
        return max(0, prompt_len - 2) // self.config.page_size

    def _admit(self, seq: Sequence) -> bool:
        """Grant ``seq`` its prompt's pages (reading what the prefix cache holds of them) and move it into the
        batch, if there is room."""
        if len(self.running) >= self.config.max_batch:
            return False
        hit = self._lookup(seq.req)
        fresh = self.config.pages_for(seq.req.prompt_len) - len(hit)
        room = self.pages.num_free + (self.cache.evictable(hit) if self.cache is not None else 0)
        if room < fresh + len(self.running):  # keep a growth page per running request
            if self.running or room < fresh:
                return False
        self.waiting.remove(seq)
        if hit:
            assert self.cache is not None  # hits come from the prefix cache
            seq.borrow(self.cache.lend(hit, seq.rid), hit)
        seq.num_computed = seq.cached = len(hit) * self.config.page_size
        self.make_room(fresh)
        seq.add_grants(self.pages.grant(seq.rid, fresh))
        self.running.append(seq)
        return True

    def cache_prompt(self, seq: Sequence) -> None:
        """``seq`` computed its prompt (and passed L3 before every step of it): hand the full pages it computed
        over to the prefix cache; it reads them on by reference. Nothing without a cache."""
        req, ps = seq.req, self.config.page_size
        full = req.prompt_len // ps
        if self.cache is None or full <= seq.shared:
            return
        scope, public = self.cache.scope(req.tenant, req.cache_salt), req.public_tokens // ps
        keys = self.cache.keys(scope, req.prompt_ids[: full * ps], public)
        owners, start = self.cache.page_owners(scope, full, public), seq.shared
        added = self.cache.insert(keys[start:], owners[start:], seq.rid, seq.grants[start:full])
        seq.hand_over(owners[start : start + added])

    def attach(self, seq: Sequence, branch: Sequence, shared_write: bool = True) -> tuple[int, int, int] | None:
        """Fork ``branch`` off ``seq``, whose prompt is computed: ``branch`` takes ``seq``'s full prompt pages by
        reference and, with ``shared_write``, a fresh page for a copy of the partial last page (without it the
        partial page is shared too: ``KVFENCE_UNSAFE=shared_write``); it joins the batch. Without a free page
        for the copy, ``branch`` waits and recomputes the prompt.

        Returns the copy the pool must make, ``(src_page, dst_page, tokens)``, or None (no copy)."""
        n, ps = seq.req.prompt_len, self.config.page_size
        full, partial = divmod(n, ps)
        copy = partial if shared_write else 0
        if copy and not self.make_room(1):
            self.add(branch)
            return None
        lent = seq.grants[: self.config.pages_for(n) if not copy else full]
        self.pages.share(seq.rid, lent, branch.rid)
        branch.borrow(seq.owners[: len(lent)], lent)
        branch.stamped = len(lent)  # the shared pages' tag records name their owner; a copy is stamped as ours
        todo = None
        if copy:
            grants = self.pages.grant(branch.rid, 1)
            todo = (seq.grants[full].page, grants[0].page, copy)
            branch.add_grants(grants)
        branch.num_computed = n
        self.add_branch(branch)
        return todo

    def _lookup(self, req: Request) -> list[PageGrant]:
        """The cached pages ``req`` may read: none without a cache or when ``req`` asks for its prompt's logprobs
        (they are computed with the prompt)."""
        if self.cache is None or req.params.prompt_logprobs is not None:
            return []
        ps = self.config.page_size
        scope = self.cache.scope(req.tenant, req.cache_salt)
        keys = self.cache.keys(scope, req.prompt_ids[: self.hit_pages(req.prompt_len) * ps], req.public_tokens // ps)
        return self.cache.match(keys)
