"""``kvfence verify`` for the prefix cache: every order of the page bookkeeping's events, over the production code.

The checked world is the colocated engine without its model: the production ``PageTable``, ``PrefixCache`` and
``Scheduler`` (admission with cache hits, chunked prompts, growth, eviction under pressure, preemption by fair
share, ``Scheduler.cache_prompt`` and ``Scheduler.attach`` for an ``n`` = 2 fork), driven by a stand-in for
``Engine.step`` that does to the bookkeeping what the engine does after a forward pass and nothing else: it
advances ``num_computed``, hands computed prompts to the cache, samples a made-up token, forks, finishes and
removes. The pool's bytes are labels: each slot holds the (tenant, salt, token prefix) whose K/V was written
there last and the page's epoch then, and ``copy_page`` copies labels.

Events, in any order: a request arrives, the engine takes a step, a choice finishes early (a stop), a client
aborts, the cache evicts a page no request holds (pressure from elsewhere; eviction under the pool's own
pressure happens inside the scheduler). Runs with more than ``max_preemptions`` preemptions are cut off, which
bounds the state space (epochs and fair-share counters only grow).

Invariants (``NAMES``), checked at every step and in every state; the first violation found is on a shortest
trace (breadth-first):

- C1 no write lands in a page with another holder (or one the writer does not own);
- C2 no page is freed or granted again while referenced: every (page, epoch) a live sequence or the cache holds
  is still held by it under that epoch;
- C3 no page is read across tenants (or salts), except public pages (owned by the cache's public owner) that hold
  only tokens of the published prefix;
- C4 the pages are accounted for: ``PageTable.check_integrity`` with the cache's pages, the table's holders
  are exactly the live sequences' grants and the cache's pages; at quiescence only cached pages remain, each
  held by the cache alone;
- C5 no stale read: every slot a step reads holds the K/V of the reader's own token prefix;
- C6 nothing waits forever: a step with requests waiting and none running admits one;
- E no production call raises.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvfence.config import EngineConfig
from kvfence.core import Request, SamplingParams, branch_rid
from kvfence.engine.scheduler import Group, Scheduler, Sequence, Work
from kvfence.kvcache.pages import PageError, PageState, PageTable
from kvfence.kvcache.prefix import PrefixCache
from kvfence.router.prefixes import PublicPrefixes
from kvfence.safety import Safety
from kvfence.verify.explorer import violation_lines

NAMES = {
    "C1": "no write into a shared page",
    "C2": "no page freed or regranted while referenced",
    "C3": "no read across tenants",
    "C4": "pages accounted for",
    "C5": "no stale read",
    "C6": "nothing waits forever",
    "E": "the page bookkeeping raised",
}
MODEL_ID = "verify"
_GRANTED, _READY, _FREE = int(PageState.GRANTED), int(PageState.READY), int(PageState.FREE)

Event = tuple  # ("submit", name) | ("step",) | ("finish", name, choice) | ("abort", name) | ("evict",)
Label = tuple[str, str | None, tuple[int, ...], int]  # (tenant, salt, token prefix, epoch): whose K/V a slot holds


@dataclass(frozen=True)
class CacheRequest:
    """One request of the configuration: ``prompt`` token ids, ``max_tokens``, ``n`` choices."""

    name: str
    tenant: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    salt: str | None = None

    def describe(self) -> str:
        """As ``kvfence verify --cache-requests`` takes it: NAME=TENANT[/SALT]:1.2.3+MAX_TOKENS[xN]."""
        salt = "" if self.salt is None else f"/{self.salt}"
        n = "" if self.n == 1 else f"x{self.n}"
        return f"{self.name}={self.tenant}{salt}:{'.'.join(map(str, self.prompt))}+{self.max_tokens}{n}"


DEFAULT_CACHE_REQUESTS = (
    CacheRequest("A", "alice", (1, 2, 3, 4), 3),  # two full pages, cached; grows a page to decode
    CacheRequest("C", "bob", (1, 2, 3), 3, n=2),  # A's first page, another tenant; a partial last page; forks
    CacheRequest("B", "bob", (1, 2, 3, 4), 1),  # A's prompt: may read C's first page, never A's
)


@dataclass(frozen=True)
class CacheConfig:
    """What the cache check explores. ``careless_evict`` is the test-only mutation ``CarelessCache``."""

    requests: tuple[CacheRequest, ...] = DEFAULT_CACHE_REQUESTS
    pages: int = 5
    page_size: int = 2
    chunk_size: int = 2
    step_tokens: int = 2
    max_batch: int = 3
    max_preemptions: int = 1
    arrival: str = "ordered"  # ordered: requests arrive in the order given (anything may come between); any
    finish_early: bool = True  # a choice may stop before max_tokens
    abort: bool = True  # a client may abort at any point
    evict_any_time: bool = False  # the cache may also evict an unheld page at any point, not only for room
    safety: Safety = field(default_factory=Safety)
    careless_evict: bool = False
    published: tuple[int, ...] = ()  # a prefix an admin published: prompts that start with it share its pages
    overmark_public: bool = False  # a MUTANT router: every prompt's every token is marked public

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_context=self.pages * self.page_size, kv_pool_tokens=self.pages * self.page_size,
                            page_size=self.page_size, max_batch=self.max_batch, chunk_size=self.chunk_size,
                            step_tokens=self.step_tokens, prefix_caching=True)

    def describe(self) -> str:
        off = ",".join(self.safety.disabled) or "none"
        extra = " careless_evict" if self.careless_evict else ""
        extra += f" published {'.'.join(map(str, self.published))}" if self.published else ""
        extra += " overmark_public" if self.overmark_public else ""
        return (f"requests {' '.join(r.describe() for r in self.requests)}; {self.pages} pages of "
                f"{self.page_size} tokens, chunk {self.chunk_size}, step {self.step_tokens} tokens, "
                f"arrival {self.arrival}, at most {self.max_preemptions} preemption(s); unsafe {off}{extra}")


class CarelessCache(PrefixCache):
    """A MUTANT for the checker's own test: eviction that ignores refcounts and takes a page back from its
    readers (``PrefixCache.evict`` frees only pages the cache alone holds). Never used outside the checker."""

    def evict(self, n: int) -> int:
        victims = list(self.entries)[:n]
        for key in victims:
            grant = self.entries.pop(key)
            del self.key_of[grant.page]
            self.pages.holders.pop(grant.page, None)  # the bug: the readers' references are forgotten
            self.pages.free(self.held.pop(grant.page), [grant])
        self.evictions += len(victims)
        return len(victims)


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str


class CacheWorld:
    """One state: the production page table, prefix cache and scheduler, the engine stand-in's tracked
    choices (``seqs``, as ``Engine.seqs``), each request's phase and the pool's slot labels."""

    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.config = cfg.engine_config()
        self.pages = PageTable(self.config.num_pages)
        cls = CarelessCache if cfg.careless_evict else PrefixCache
        self.cache = cls(self.pages, cfg.page_size, MODEL_ID, cfg.safety.prefix_scope)
        self.sched = Scheduler(self.config, self.pages, self.cache)
        self.seqs: dict[int, Sequence] = {}
        self.heads: dict[str, Sequence] = {}  # choice 0 of each request that arrived
        self.phase = {r.name: "new" for r in cfg.requests}  # new -> open -> ended
        self.labels: dict[int, list[Label | None]] = {p: [None] * cfg.page_size for p in range(cfg.pages)}
        self.names = self._names()  # owner id -> name in traces: request rids, then choices' rids
        self.violations: list[Violation] = []
        self.log: list[str] = []
        self.notes: set[str] = set()  # what the latest event exercised (``COVERAGE``), for the report
        self.pruned = False

    def _names(self) -> dict[int, str]:
        names = {}
        for i, r in enumerate(self.cfg.requests):
            names[i + 1] = r.name
            names.update({branch_rid(i + 1, k): f"{r.name}#{k}" for k in range(1, r.n)})
        return names

    # -- state -------------------------------------------------------------------

    def frozen(self) -> bytes:
        """This state as bytes; ``thaw`` gives an independent copy (the explorer's clone). What never changes
        (the configuration, sampling parameters, names) is shared, not copied; so are the sequences' L3 tag
        arrays, which only ``Engine._verify`` reads (they are rebuilt on a sequence's next ``add_grants``)."""
        log, notes, self.log, self.notes = self.log, self.notes, [], set()
        seqs = [q for head in self.heads.values() for q in (head.group.branches if head.group else [head])]
        tags = [q.tags for q in seqs]
        for q in seqs:
            q.tags = ()
        try:
            buf = io.BytesIO()
            _Freezer(buf, self).dump(self)
            return buf.getvalue()
        finally:
            self.log, self.notes = log, notes
            for q, t in zip(seqs, tags, strict=True):
                q.tags = t

    def thaw(self, blob: bytes) -> CacheWorld:
        """The state ``frozen`` gave as ``blob`` (frozen from this world or one of its copies)."""
        return _Thawer(io.BytesIO(blob), self).load()

    def _constants(self) -> list[object]:
        """What ``frozen`` shares by reference: these objects, then sampling parameters equal to these."""
        return [self.cfg, self.config, self.names,
                *(SamplingParams(max_tokens=r.max_tokens, n=r.n) for r in self.cfg.requests)]

    def key(self) -> bytes:
        """A 128-bit hash of the canonical state (everything the bookkeeping's future depends on)."""
        p, c, s = self.pages, self.cache, self.sched
        parts = (
            p.owner_hi.tobytes(), p.owner_lo.tobytes(), p.epoch.tobytes(), p.filled.tobytes(), p.state.tobytes(),
            tuple(p._free), sorted((page, sorted(h)) for page, h in p.holders.items()),
            [(k, g.page, g.epoch) for k, g in c.entries.items()], sorted(c.held.items()), sorted(c.owners),
            [q.rid for q in s.waiting], [q.rid for q in s.running], sorted(s.shares.served.items()),
            s.shares.virtual_time, s.arrivals, s.num_preempted, sorted(self.phase.items()),
            [self._seq_key(q) for _, q in sorted(self.seqs.items())],
            [(n, h.group.forked, h.group.open) for n, h in sorted(self.heads.items()) if h.group is not None],
            [tuple(slots) for page, slots in sorted(self.labels.items()) if p.state[page] != _FREE],
        )
        return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()  # repr: canonical, unlike pickle

    @staticmethod
    def _seq_key(q: Sequence) -> tuple:
        return (q.rid, [(g.page, g.epoch) for g in q.grants], q.lenders, q.num_computed, q.cached,
                tuple(q.req.output_ids), q.arrival, q.preemptions)

    def quiescent(self) -> bool:
        return all(ph == "ended" for ph in self.phase.values())

    # -- events ------------------------------------------------------------------

    def events(self) -> list[Event]:
        """Every event enabled in this state."""
        out: list[Event] = []
        for i, r in enumerate(self.cfg.requests):
            if self.phase[r.name] == "new" and (self.cfg.arrival == "any" or i == 0
                                                 or self.phase[self.cfg.requests[i - 1].name] != "new"):
                out.append(("submit", r.name))
        if self.sched.has_work:
            out.append(("step",))
        for r in self.cfg.requests:
            if self.phase[r.name] != "open":
                continue
            if self.cfg.finish_early:
                out += [("finish", r.name, q.index) for q in self._live(self.heads[r.name]) if self._just_sampled(q)]
            if self.cfg.abort:
                out.append(("abort", r.name))
        if self.cfg.evict_any_time and self.cache.evictable():
            out.append(("evict",))
        return out

    def _just_sampled(self, q: Sequence) -> bool:
        """``q`` is running with a sampled token not yet fed back: a stop could end it now."""
        return q in self.sched.running and bool(q.req.output_ids) and q.num_computed == q.num_tokens - 1

    def apply(self, ev: Event) -> None:
        """Run ``ev`` through the production code; record violations in ``violations``."""
        kind = ev[0]
        if kind == "submit":
            self._submit(self._spec(ev[1]))
        elif kind == "step":
            self._step()
        elif kind == "finish":
            q = next(q for q in self._live(self.heads[ev[1]]) if q.index == ev[2])
            self.notes.add("early stop")
            self.log.append(f"{self._name(q.rid)} stops early (a stop sequence)")
            self._end(q)
        elif kind == "abort":
            self.notes.add("abort")
            self.log.append(f"client of {ev[1]} aborts")
            for q in self._live(self.heads[ev[1]]):
                self._end(q)
        elif kind == "evict":
            before = dict(self.cache.held)
            self.cache.evict(1)
            gone = sorted(set(before) - set(self.cache.held))
            self.notes.add("eviction (event)")
            self.log.append(f"the cache evicts (pressure from elsewhere): pages {gone}")
        else:
            raise ValueError(f"unknown event {ev!r}")

    def _public_tokens(self, prompt: tuple[int, ...]) -> int:
        """What the router marks public (``PublicPrefixes.match``): the published prefix, where ``prompt`` starts
        with it."""
        if self.cfg.overmark_public:
            return len(prompt)
        prefixes = PublicPrefixes()
        if self.cfg.published:
            prefixes.publish(self.cfg.published, "admin")
        return prefixes.match(prompt)

    def _public(self, page: int, label: Label) -> bool:
        """Whether every tenant may read ``label`` in ``page``: a public page holding published tokens only."""
        published, tokens = self.cfg.published, label[2]
        return self.pages.owner_of(page) == self.cache.public_owner and tokens == published[: len(tokens)]

    def _spec(self, name: str) -> CacheRequest:
        return next(r for r in self.cfg.requests if r.name == name)

    def _submit(self, spec: CacheRequest) -> None:
        """``Engine.add``/``Engine._open``: choice 0 queues; other choices wait to fork."""
        rid = 1 + self.cfg.requests.index(spec)
        params = SamplingParams(max_tokens=spec.max_tokens, n=spec.n)
        public = self._public_tokens(spec.prompt)
        req = Request(list(spec.prompt), params, spec.tenant, rid=rid, cache_salt=spec.salt, public_tokens=public)
        head = Sequence(req)
        if spec.n > 1:
            others = []
            for i in range(1, spec.n):
                r = Request(list(spec.prompt), params, spec.tenant, rid=branch_rid(rid, i), cache_salt=spec.salt,
                            public_tokens=public)
                others.append(Sequence(r, index=i))
            head.group = Group(rid, [head, *others], [None] * spec.n, open=spec.n)
            for q in others:
                q.group = head.group
        self.seqs[rid], self.heads[spec.name], self.phase[spec.name] = head, head, "open"
        self.sched.add(head)
        self.log.append(f"{spec.name} ({spec.tenant}) arrives: {len(spec.prompt)} prompt tokens, "
                        f"max {spec.max_tokens}, n={spec.n}")

    def _step(self) -> None:
        """``Engine.step`` less the model: schedule, check what the step reads and writes, then the bookkeeping
        ``Engine._sample`` does."""
        before = (list(self.sched.waiting), {q: q.preemptions for q in self.sched.running}, dict(self.cache.held))
        starved = not self.sched.running and bool(self.sched.waiting)
        work = self.sched.schedule()
        self._scheduled(*before)
        if self.sched.num_preempted > self.cfg.max_preemptions:
            self.pruned = True
            return
        if starved and not work:
            self.violations.append(Violation("C6", "requests wait, none runs, and the step admits none: "
                                             + ", ".join(self._name(q.rid) for q in self.sched.waiting)))
        for w in work:
            self.log.append(f"step: {self._name(w.seq.rid)} computes positions [{w.start}, {w.end}) "
                            f"in pages {w.pages_written(self.config.page_size)} of {w.seq.page_ids}")
        self.violations += self._check_step(work)
        if self.violations:
            return
        for w in work:
            w.seq.num_computed = w.end
        for w in work:
            if w.start < w.seq.req.prompt_len == w.end:
                self._cache_prompt(w.seq)
        for w in work:
            if w.samples and self.seqs.get(w.seq.rid) is w.seq:
                self._sample(w.seq)

    def _scheduled(self, waiting: list[Sequence], running: dict[Sequence, int], cached: dict[int, int]) -> None:
        """Log what ``schedule`` did besides the work: evictions for room, preemptions, admissions."""
        self._evicted(cached)
        for q, preemptions in running.items():
            if q.preemptions > preemptions:
                self.notes.add("preemption")
                self.log.append(f"{self._name(q.rid)} is preempted: its pages go back, it will recompute")
        for q in waiting:
            if q in self.sched.running:
                self.notes.add("cache hit" if q.cached else "admission")
                if self.cache.public_owner in q.lenders:
                    self.notes.add("public hit")
                self.log.append(f"{self._name(q.rid)} is admitted: reads {q.shared} cached page(s) "
                                f"{q.page_ids[: q.shared]}, gets pages {q.page_ids[q.shared :]}")

    def _check_step(self, work: list[Work]) -> list[Violation]:
        """C2 for the pages each step's sequence reads, C1 for those it writes, then the writes land and C3
        and C5 hold for every slot it reads."""
        out = [v for w in work for v in self._held(w.seq)]
        out += [v for w in work for v in self._writable(w)]
        if out:
            return out
        for w in work:  # the K/V lands
            for pos in range(w.start, w.end):
                slots, i = self._slot(w.seq, pos)
                slots[i] = self._label(w.seq, pos)
        return [v for w in work for v in self._reads(w)]

    def _cache_prompt(self, q: Sequence) -> None:
        before = set(self.cache.held)
        self.sched.cache_prompt(q)
        if added := sorted(set(self.cache.held) - before):
            self.notes.add("cache insert")
            self.log.append(f"the cache takes pages {added} of {self._name(q.rid)}'s prompt")

    def _sample(self, q: Sequence) -> None:
        """``Engine._sample`` for one sequence: fork at the first token of a request with choices, then each
        choice records its token and ends at ``max_tokens``."""
        group = q.group
        if group is not None and not group.forked:
            group.forked = True
            for branch in group.branches[1:]:
                self.seqs[branch.rid] = branch
                self._attach(q, branch)
            for branch in group.branches:
                self._on_token(branch)
        else:
            self._on_token(q)

    def _evicted(self, before: dict[int, int]) -> None:
        """Log the pages evicted for room since the cache held ``before``."""
        if gone := sorted(set(before) - set(self.cache.held)):
            self.notes.add("eviction under pressure")
            self.log.append(f"the cache evicts pages {gone} for room")

    def _attach(self, q: Sequence, branch: Sequence) -> None:
        cached = dict(self.cache.held)
        copy = self.sched.attach(q, branch, self.cfg.safety.shared_write)
        self._evicted(cached)
        if copy is not None:  # KVPool.copy_page on labels
            src, dst, tokens = copy
            epoch = int(self.pages.epoch[dst])
            self.labels[dst][:tokens] = [lab and (*lab[:3], epoch) for lab in self.labels[src][:tokens]]
        self.notes.add("fork: copy" if copy else "fork: wait" if branch in self.sched.waiting else "fork: shared")
        how = f"copies page {copy[0]} into {copy[1]}" if copy else "waits for a page" if branch in \
            self.sched.waiting else "copies nothing"
        self.log.append(f"{self._name(branch.rid)} forks: shares pages {branch.page_ids[: branch.shared]}, {how}")

    def _on_token(self, q: Sequence) -> None:
        token = 50 + 10 * q.index + len(q.req.output_ids)
        q.req.output_ids.append(token)
        self.log.append(f"{self._name(q.rid)} samples token {token}")
        if len(q.req.output_ids) >= q.req.params.max_tokens:
            self._end(q)

    def _end(self, q: Sequence) -> None:
        """``Engine._end``: forget the choice and free its pages; the request ends with its last choice."""
        self.sched.remove(q)
        del self.seqs[q.rid]
        self.log.append(f"{self._name(q.rid)} ends; its pages go back")
        head = q.group.branches[0] if q.group is not None else q
        if q.group is not None:
            q.group.open -= 1
        if not self._live(head):
            self.phase[self.names[head.rid]] = "ended"

    def _live(self, head: Sequence) -> list[Sequence]:
        branches = head.group.branches if head.group is not None else [head]
        return [b for b in branches if self.seqs.get(b.rid) is b]

    # -- checks --------------------------------------------------------------------

    def _label(self, q: Sequence, pos: int) -> Label:
        """What slot ``pos`` of ``q`` must hold: its tenant's and salt's K/V of its prefix, under the epoch of its
        page's grant (a page granted again holds only stale bytes until written)."""
        grant = q.grants[pos // self.config.page_size]
        return (q.req.tenant, q.req.cache_salt, tuple(q.req.all_ids[: pos + 1]), grant.epoch)

    def _slot(self, q: Sequence, pos: int) -> tuple[list[Label | None], int]:
        ps = self.config.page_size
        return self.labels[q.grants[pos // ps].page], pos % ps

    def _held(self, q: Sequence) -> list[Violation]:
        """C2 for one sequence: it still holds every grant it reads, under that grant's epoch."""
        return [Violation("C2", f"{self._name(q.rid)} reads page {g.page} (epoch {g.epoch}), which it no longer "
                                f"holds: {self._page(g.page)}")
                for g in q.grants if not self.pages.holds(q.rid, g)]

    def _writable(self, w: Work) -> list[Violation]:
        """C1: every page ``w`` writes has one holder, its writer."""
        out = []
        for page in w.pages_written(self.config.page_size):
            holders = self.pages.refcount(page)
            if holders > 1 or self.pages.owner_of(page) != w.seq.rid:
                out.append(Violation("C1", f"{self._name(w.seq.rid)} writes positions [{w.start}, {w.end}) into "
                                           f"page {page}: {self._page(page)}"))
        return out

    def _reads(self, w: Work) -> list[Violation]:
        """C3 and C5 for every slot ``w``'s sequence reads (positions [0, end))."""
        q = w.seq
        for pos in range(w.end):
            slots, i = self._slot(q, pos)
            got, want = slots[i], self._label(q, pos)
            page = q.grants[pos // self.config.page_size].page
            if got is not None and got[:2] != want[:2] and not self._public(page, got):
                return [Violation("C3", f"{self._name(q.rid)} ({want[0]}, salt {want[1]}) reads position {pos} "
                                        f"from page {page}, holding K/V of {got[0]} (salt {got[1]}): "
                                        f"{self._page(page)}")]
            if got is None or got[2:] != want[2:]:  # whose it is was C3's question
                what = "nothing" if got is None else f"{got[2]} written under epoch {got[3]}"
                return [Violation("C5", f"{self._name(q.rid)} reads position {pos} from page {page}, which holds "
                                        f"{what}, not {want[2]} under epoch {want[3]}")]
        return []

    def check_state(self) -> list[Violation]:
        """C2 and C4 in this state (plus C4 at quiescence)."""
        out = [v for q in self.seqs.values() for v in self._held(q)]
        out += [Violation("C2", f"the cache's entry for page {g.page} (epoch {g.epoch}) is no longer the cache's: "
                                f"{self._page(g.page)}")
                for g in self.cache.entries.values() if not self.pages.holds(self.cache.held.get(g.page, 0), g)]
        return out + self._accounted() + (self._drained() if self.quiescent() else [])

    def _accounted(self) -> list[Violation]:
        """C4: the table is consistent and its holders are exactly the live grants and the cache's pages."""
        try:
            self.pages.check_integrity(self.cache.held, self.cache.owners)
        except PageError as exc:
            return [Violation("C4", f"PageTable.check_integrity: {exc}")]
        want = Counter([g.page for q in self.seqs.values() for g in q.grants] + list(self.cache.held))
        state = self.pages.state
        held = [p for p in range(self.pages.num_pages) if _GRANTED <= state[p] <= _READY]
        if sorted(want) != held:
            return [Violation("C4", f"pages held {held} differ from the pages of live choices and the cache "
                                    f"{sorted(want)}")]
        bad = [p for p, n in want.items() if self.pages.refcount(p) != n]
        return [Violation("C4", f"page {p}: {self._page(p)}, but {want[p]} live holder(s)") for p in bad]

    def _drained(self) -> list[Violation]:
        """C4 at quiescence: nothing queued, and only cached pages held, each by the cache alone."""
        out = []
        if self.sched.has_work or self.seqs:
            out.append(Violation("C4", "at quiescence the scheduler still holds work"))
        for p in range(self.pages.num_pages):
            if self.pages.state[p] != _FREE and (p not in self.cache.held or self.pages.refcount(p) != 1):
                out.append(Violation("C4", f"at quiescence page {p} is {self._page(p)}"))
        return out

    # -- words ---------------------------------------------------------------------

    def _name(self, owner: int) -> str:
        if owner in self.names:
            return self.names[owner]
        for tenant, salt in {(r.tenant, r.salt) for r in self.cfg.requests}:
            if self.cache.owner(self.cache.scope(tenant, salt)) == owner:
                scope = tenant if salt is None else f"{tenant}/{salt}"
                return f"cache({scope})" if self.cfg.safety.prefix_scope else "cache (one scope for all)"
        return "public cache" if owner == self.cache.public_owner else "nobody" if owner == 0 else f"{owner:032x}"

    def _page(self, page: int) -> str:
        p = self.pages
        state = PageState(p.state[page]).name.lower()
        if state == "free":
            return f"page {page} is free (epoch {int(p.epoch[page])})"
        holders = sorted(self._name(h) for h in p.holders.get(page, {p.owner_of(page)}))
        return (f"page {page} is {state}, epoch {int(p.epoch[page])}, owned by {self._name(p.owner_of(page))}, "
                f"held by {', '.join(holders)}")


class _Freezer(pickle.Pickler):
    """Pickles a ``CacheWorld`` by value but its constants by reference (``persistent_id``)."""

    def __init__(self, buf: io.BytesIO, world: CacheWorld) -> None:
        super().__init__(buf, pickle.HIGHEST_PROTOCOL)
        constants = world._constants()
        self.ids = {id(c): i for i, c in enumerate(constants) if not isinstance(c, SamplingParams)}  # live objects
        self.params = {c: i for i, c in enumerate(constants) if isinstance(c, SamplingParams)}  # by value

    def persistent_id(self, obj: object) -> int | None:
        if isinstance(obj, SamplingParams):
            return self.params.get(obj)
        return self.ids.get(id(obj))


class _Thawer(pickle.Unpickler):
    def __init__(self, buf: io.BytesIO, world: CacheWorld) -> None:
        super().__init__(buf)
        self.constants = world._constants()

    def persistent_load(self, pid: int) -> object:
        return self.constants[pid]


# -- exploration -------------------------------------------------------------------


@dataclass
class CacheResult:
    config: CacheConfig
    states: int = 0
    transitions: int = 0
    pruned: int = 0  # transitions cut off at max_preemptions
    depth: int = 0
    seconds: float = 0.0
    complete: bool = False
    quiescent: int = 0
    coverage: Counter = field(default_factory=Counter)  # transitions that exercised each kind of bookkeeping
    violation: Violation | None = None
    trace: list[list[str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violation is None and self.complete

    def report(self) -> str:
        lines = [f"prefix-cache pages: {self.config.describe()}"]
        status = "complete" if self.complete else "stopped early"
        lines.append(f"explored {self.states:,} states, {self.transitions:,} transitions, depth {self.depth}, "
                     f"in {self.seconds:.1f}s ({status}); {self.quiescent:,} quiescent states; {self.pruned:,} "
                     f"transitions past {self.config.max_preemptions} preemption(s) cut off")
        lines.append("exercised: " + ", ".join(f"{k} {n:,}" for k, n in sorted(self.coverage.items())))
        if self.violation is None:
            lines.append("no violation" + ("" if self.complete else " found so far (state cap reached)"))
            return "\n".join(lines)
        v = self.violation
        lines += violation_lines(v.invariant, NAMES[v.invariant], v.message, self.trace)
        return "\n".join(lines)

    def as_dict(self) -> dict:
        v = self.violation
        return {"states": self.states, "transitions": self.transitions, "pruned": self.pruned, "depth": self.depth,
                "seconds": round(self.seconds, 3), "complete": self.complete, "quiescent": self.quiescent,
                "coverage": dict(sorted(self.coverage.items())),
                "violation": None if v is None else {"invariant": v.invariant, "name": NAMES[v.invariant],
                                                     "message": v.message, "trace": self.trace}}


def explore_cache(cfg: CacheConfig | None = None, max_states: int = 500_000) -> CacheResult:
    """Explore every state of ``cfg`` breadth-first; stop at the first violation (its trace is a shortest).
    A quiescent state (every request ended) is checked and not expanded: nothing can read a page any more."""
    cfg = cfg or CacheConfig()
    res, t0 = CacheResult(cfg), time.monotonic()
    init = CacheWorld(cfg)  # every state is thawed through it (the constants it shares)
    seen = {init.key(): 0}
    parent, via = [-1], [None]
    found = _first(init.check_state(), 0, None)
    frontier = [(0, init.frozen())]
    while frontier and found is None and len(seen) < max_states:
        nxt: list[tuple[int, bytes]] = []
        for sid, blob in frontier:
            found = _expand(init, blob, sid, seen, parent, via, nxt, res)
            if found is not None or len(seen) >= max_states:
                break
        frontier = nxt
        res.depth += bool(frontier)
    res.states, res.complete = len(seen), found is None and len(seen) < max_states
    if found is not None:
        sid, ev, res.violation = found
        res.trace = _trace(cfg, _path(parent, via, sid) + ([ev] if ev is not None else []))
    res.seconds = time.monotonic() - t0
    return res


def _expand(root: CacheWorld, blob: bytes, sid: int, seen: dict[bytes, int], parent: list[int], via: list,
            nxt: list[tuple[int, bytes]], res: CacheResult) -> tuple[int, Event | None, Violation] | None:
    """Every successor of the state ``blob`` (``CacheWorld.frozen``): new ones go to ``nxt``; returns the first
    violation found."""
    w = root.thaw(blob)
    if w.quiescent():
        res.quiescent += 1
        return None
    for i, ev in enumerate(w.events()):
        w2 = w if i == 0 else root.thaw(blob)
        try:
            w2.apply(ev)
        except Exception as exc:  # the production bookkeeping raised: the engine would crash here
            return sid, ev, Violation("E", f"{type(exc).__name__}: {exc}")
        if w2.pruned:
            res.pruned += 1
            continue
        res.transitions += 1
        res.coverage.update(w2.notes)
        if w2.violations:
            return sid, ev, w2.violations[0]
        k = w2.key()
        if k in seen:
            continue
        seen[k] = len(parent)
        parent.append(sid)
        via.append(ev)
        if (found := _first(w2.check_state(), seen[k], None)) is not None:
            return found
        nxt.append((seen[k], w2.frozen()))
    return None


def _first(violations: Iterable[Violation], sid: int, ev: Event | None) -> tuple[int, Event | None, Violation] | None:
    return next(((sid, ev, v) for v in violations), None)


def _path(parent: list[int], via: list, sid: int) -> list[Event]:
    events = []
    while sid > 0:
        events.append(via[sid])
        sid = parent[sid]
    return events[::-1]


def _trace(cfg: CacheConfig, events: list[Event]) -> list[list[str]]:
    """Replay ``events`` from the start, with what each did in words."""
    w, steps = CacheWorld(cfg), []
    for ev in events:
        w.log = []
        try:
            w.apply(ev)
        except Exception as exc:
            w.log.append(f"!! raised {type(exc).__name__}: {exc}")
        steps.append([" ".join(map(str, ev))] + w.log)
    return steps


def with_safety(cfg: CacheConfig, unsafe: str) -> CacheConfig:
    """``cfg`` with the layers named in ``unsafe`` (as ``KVFENCE_UNSAFE``) switched off."""
    return replace(cfg, safety=Safety.from_env(unsafe))


__all__ = ["NAMES", "CacheConfig", "CacheRequest", "CacheResult", "CacheWorld", "CarelessCache", "explore_cache",
           "with_safety"]
