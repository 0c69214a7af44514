"""Continuous batching over a paged KV pool.

Every step, each running request past its prompt decodes one token, and
prompts advance by whole chunks within a token budget. Requests join and leave
the batch every step.

Contracts:
- A prompt's chunk boundaries are fixed multiples of ``chunk_size`` counted
  from its first token, whatever else is scheduled, so its computation (and
  greedy output) never depends on its neighbours.
- A request is admitted only when pages for its whole prompt can be granted;
  decode grows one page at a time. When the pool runs dry the newest running
  request is preempted: its pages are freed and it recomputes later, replaying
  its generated tokens one decode step at a time so that its KV comes out
  bit-identical.
- Admission is FIFO: a waiting request never overtakes an older one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfence.config import EngineConfig
from kvfence.core import Request
from kvfence.kvcache.pages import PageGrant, PageTable


@dataclass(eq=False)
class Sequence:
    """A request's engine-side state: its pages and how far its KV is computed."""

    req: Request
    generator: torch.Generator | None = None
    grants: list[PageGrant] = field(default_factory=list)
    num_computed: int = 0  # positions whose K/V are in the pool
    tags: tuple[np.ndarray, ...] = ()  # (pages, owner_hi, owner_lo, epochs) for PageTable.verify
    stamped: int = 0  # grants whose tag records already name this request (decode with remote writers)

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

    def add_grants(self, grants: list[PageGrant]) -> None:
        self.grants += grants
        n = len(self.grants)
        self.tags = (
            np.array(self.page_ids, dtype=np.int64),
            np.full(n, self.rid >> 64, dtype=np.uint64),
            np.full(n, self.rid & (2**64 - 1), dtype=np.uint64),
            np.array([g.epoch for g in self.grants], dtype=np.uint64),
        )

    def drop_grants(self) -> list[PageGrant]:
        grants, self.grants, self.tags = self.grants, [], ()
        self.num_computed = self.stamped = 0
        return grants


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


class Scheduler:
    def __init__(self, config: EngineConfig, pages: PageTable) -> None:
        self.config = config
        self.pages = pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preempted = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pages.free(seq.rid, seq.drop_grants())

    def schedule(self) -> list[Work]:
        work = self._schedule_decodes()
        budget = self.config.step_tokens
        for seq in self.running:
            if seq.in_prefill:
                budget = self._add_chunk(seq, work, budget)
        self._admit(work, budget)
        return work

    def _schedule_decodes(self) -> list[Work]:
        work = []
        for seq in list(self.running):
            if seq in self.running and not seq.in_prefill and self._grow(seq):
                work.append(Work(seq, seq.num_computed, seq.num_computed + 1))
        return work

    def _grow(self, seq: Sequence) -> bool:
        """Make sure ``seq`` has a page for its next position; preempt the newest if needed.

        Returns False when ``seq`` itself had to be preempted.
        """
        if self.config.pages_for(seq.num_computed + 1) <= len(seq.grants):
            return True
        while not self.pages.can_grant(1):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.add_grants(self.pages.grant(seq.rid, 1))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pages.free(seq.rid, seq.drop_grants())
        self.waiting.appendleft(seq)
        self.num_preempted += 1

    def _add_chunk(self, seq: Sequence, work: list[Work], budget: int) -> int:
        chunk = self.config.chunk_size
        start = seq.num_computed
        end = min(seq.req.prompt_len, (start // chunk + 1) * chunk)
        if end - start > budget and budget < self.config.step_tokens:
            return 0  # out of budget; the step's first chunk always runs, so no prompt starves
        work.append(Work(seq, start, end))
        return budget - (end - start)

    def _admit(self, work: list[Work], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            need = self.config.pages_for(seq.req.prompt_len)
            if not self.pages.can_grant(need + len(self.running)):  # keep a growth page per running request
                if self.running or not self.pages.can_grant(need):
                    break
            self.waiting.popleft()
            seq.add_grants(self.pages.grant(seq.rid, need))
            self.running.append(seq)
            budget = self._add_chunk(seq, work, budget)
