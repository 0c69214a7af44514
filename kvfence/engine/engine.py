"""The colocated engine: scheduler + model + KV pool, one step at a time.

Not thread-safe: one thread owns an ``Engine`` and calls ``add``, ``abort``
and ``step``; ``local.py`` puts it behind an async interface.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable

import numpy as np
import torch

from kvfence.config import EngineConfig
from kvfence.core import (
    ContextLengthExceeded,
    FinishReason,
    IntegrityError,
    InvalidRequest,
    Request,
    RequestOutput,
    TokenLogprob,
    branch_rid,
)
from kvfence.engine.grammar import Guide, ll_tokenizer
from kvfence.engine.output import OutputTracker
from kvfence.engine.sampler import logprob_of, make_generator, sample, token_logprobs
from kvfence.engine.scheduler import Group, Scheduler, Sequence, Work
from kvfence.kvcache.pages import PageError, PageGrant, PageState, PageTable
from kvfence.kvcache.pool import KVPool
from kvfence.kvcache.prefix import PrefixCache
from kvfence.model.batch import SeqChunk
from kvfence.model.llama import Model
from kvfence.model.tokenizer import Tokenizer
from kvfence.preflight import preflight, usable_pool_tokens
from kvfence.safety import Safety

log = logging.getLogger(__name__)


class Engine:
    """Scheduler + model + KV pool.

    Before every step reads its pages, each page's owner and epoch are checked against the page table
    (L3), and a sequence reading pages shared with it must hold a reference to each. With ``remote_writes``
    (decode: other processes write into this pool) the pages' tag records are checked too, so a late write from
    an earlier grant is caught before its bytes are read; the engine then stamps the tag records of pages it
    fills itself.

    A request with ``n`` choices computes its prompt once (choice 0). At its first token every choice samples
    from the same logits with its own generator and forks: the prompt's full pages are shared read-only (the
    page table counts their holders), its partial last page is copied per choice, and no step writes into a
    page with more than one holder (``PageTable.check_writable``; ``KVFENCE_UNSAFE=shared_write`` shares the
    partial page instead, for the test that shows the harm). A choice with no page for its copy waits and
    recomputes the prompt like a preempted request.

    Prefix caching (``config.prefix_caching``, never with ``remote_writes``: only pages this engine computed are
    cached): the scheduler lends a request the cached pages of its prompt's longest cached prefix, in its
    tenant's scope (``kvcache/prefix.py``), and once the prompt is computed its full pages are handed over to
    the cache, which the request goes on reading by reference. ``KVFENCE_UNSAFE=prefix_scope`` leaves tenant and
    salt out of the keys. A request's first output says how many prompt tokens it read from the cache.
    """

    decodes = True  # requests decode here: the model prepares for decode rows at start (not at the first one)

    def __init__(self, model: Model, tokenizer: Tokenizer, config: EngineConfig, dtype: torch.dtype,
                 device: str = "cpu", pool: KVPool | None = None, safety: Safety | None = None,
                 remote_writes: bool = False) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.safety = safety or Safety.from_env()
        if self.safety.preflight:  # L0: a pool that cannot hold one request of the full context never serves
            preflight(config.role, usable_pool_tokens(config.kv_pool_tokens, config.page_size), config.max_context,
                      page_size=config.page_size)
        self.pool = pool or KVPool(model.config, config.num_pages, config.page_size, dtype, device)
        self.region = self.pool.region if remote_writes else None
        self.pages = PageTable(config.num_pages)
        self.cache = (PrefixCache(self.pages, config.page_size, f"{model.config}/{dtype}", self.safety.prefix_scope)
                      if config.prefix_caching and not remote_writes else None)
        self.scheduler = Scheduler(config, self.pages, self.cache)
        self.seqs: dict[int, Sequence] = {}
        self.trackers: dict[int, OutputTracker] = {}
        self.prompt_tokens_computed = 0  # prompt positions whose K/V this engine computed (recomputes included)
        if self.decodes:
            model.backend.prepare_decode_rows()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def free_pages(self) -> int:
        """Pages a grant may take: free ones and cached ones no request holds (evicted on demand)."""
        return self.pages.num_free + (self.cache.evictable() if self.cache is not None else 0)

    @property
    def token_limit(self) -> int:
        """Most tokens (prompt + completion) one request may hold: context and pool both bound it."""
        return min(self.config.max_context, self.config.num_pages * self.config.page_size)

    def add(self, req: Request) -> None:
        """Queue a request. Raises ``KvfenceError`` before any page is granted if it cannot be served."""
        if req.prompt_len == 0:
            raise InvalidRequest("The prompt is empty.", param="prompt")
        if req.prompt_len + req.params.max_tokens > self.token_limit:
            raise ContextLengthExceeded(req.prompt_len, req.params.max_tokens, self.token_limit)
        if req.rid in self.seqs:
            raise InvalidRequest("duplicate request id")
        self.check_token_ids(req)
        self.scheduler.add(self._open(req))

    def check_token_ids(self, req: Request) -> None:
        """Token ids named by the sampling parameters must be in the model's vocabulary."""
        vocab = self.model.config.vocab_size
        for param, ids in (("logit_bias", [t for t, _ in req.params.logit_bias]),
                           ("stop_token_ids", req.params.stop_token_ids)):
            if ids and not 0 <= min(ids) <= max(ids) < vocab:
                raise InvalidRequest(f"Token ids in '{param}' must be between 0 and {vocab - 1}.", param=param)

    def _guide(self, req: Request) -> Guide | None:
        if req.params.grammar is None:
            return None
        return Guide(req.params.grammar, ll_tokenizer(self.tokenizer, self.model.config.vocab_size))

    def add_prefilled(self, req: Request, grants: list[PageGrant], firsts: list[tuple[int, TokenLogprob | None]],
                      prompt_logprobs: list[TokenLogprob] | None = None, cached_tokens: int = 0
                      ) -> list[RequestOutput]:
        """Take over a request whose prompt KV already sits, verified, in ``grants``; continue decoding.
        ``firsts``: each choice's first token (and its logprob), sampled by prefill; ``cached_tokens``: how many
        prompt tokens prefill read from its prefix cache.

        The pages must be held by ``req.rid`` in this engine's page table.
        """
        seq = self._open(req)
        seq.add_grants(grants)
        seq.num_computed, seq.cached = req.prompt_len, cached_tokens
        seq.stamped = len(grants)  # prefill wrote these tag records, checked on landing
        self.scheduler.add_running(seq)
        self.trackers[req.rid].prompt_logprobs = prompt_logprobs or []
        if seq.group is not None:
            return self._fork(seq, firsts)
        out = self._on_token(seq, *firsts[0])
        return [] if out is None else [out]

    def abort(self, rid: int) -> RequestOutput | None:
        """Drop a request wherever it is and free its pages; None if it is unknown or already ended."""
        seq = self.seqs.get(rid)
        if seq is None:
            return None
        for branch in self._live(seq):
            self._end(branch)
        tokens = seq.group.tokens if seq.group is not None else len(seq.req.output_ids)
        return RequestOutput(rid, [], "", FinishReason.ABORT, prompt_tokens=seq.req.prompt_len,
                             completion_tokens=tokens)

    def step(self) -> list[RequestOutput]:
        """Schedule, verify, compute and sample one batch; return what each request produced."""
        work = self.scheduler.schedule()
        if not work:
            return []
        work, outputs = self._verify(work)
        if work and self.safety.shared_write:
            self._check_writes(work)
        if work:
            scored = any(self._scores_prompt(w) for w in work)
            logits = self.model.forward([self._chunk(w) for w in work], self.pool, all_logits=scored)
            if scored:
                logits = self._score_prompts(work, logits)
            outputs += self._sample(work, logits)
        return outputs

    def check_integrity(self, also_held: Iterable[int] = ()) -> None:
        """The page table is consistent, and the pages it says are held are exactly those of live requests and
        the prefix cache (plus ``also_held``: pages other owners on this thread hold, e.g. grants awaiting a
        transfer)."""
        cached = self.cache.held if self.cache is not None else {}
        self.pages.check_integrity(cached, self.cache.owners if self.cache is not None else ())
        held = Counter([g.page for s in self.seqs.values() for g in s.grants] + list(also_held) + list(cached))
        state = self.pages.state
        table = np.flatnonzero((state >= PageState.GRANTED) & (state <= PageState.READY)).tolist()
        if sorted(held) != table:
            raise PageError(f"pages held by the table ({len(table)}) differ from pages held by live requests "
                            f"({len(held)})")
        if any(self.pages.refcount(page) != n for page, n in held.items()):
            raise PageError("a page's holders in the table differ from the live requests reading it")

    # -- internals -----------------------------------------------------------

    def _chunk(self, w: Work) -> SeqChunk:
        ids = w.seq.req.all_ids[w.start : w.end]
        return SeqChunk(ids, w.start, w.seq.page_ids)

    def _verify(self, work: list[Work]) -> tuple[list[Work], list[RequestOutput]]:
        """L3: check owner and epoch of every page each sequence reads this step (one vectorised pass)."""
        if not self.safety.tags:
            return work, []
        if self.region is not None:
            self._stamp_new_grants(work)
        if self.pages.holders or any(w.seq.shared for w in work):
            work, failed = self._check_references(work)
            if failed:
                good, outputs = self._verify(work)
                return good, outputs + self._fail_all(failed)
        if self.pages.all_held([w.seq.tags for w in work], None if self.region is None else self.region.tags):
            return work, []  # the fast path's proof; otherwise NumPy checks again and names the failures
        tags = work[0].seq.tags if len(work) == 1 else [np.concatenate(parts) for parts in
                                                         zip(*(w.seq.tags for w in work), strict=True)]
        ok = self.pages.verify(*tags)
        if self.region is not None:
            ok &= self.region.tags_match(*tags)
        if ok.all():
            return work, []
        good, failed, offset = [], [], 0
        for w in work:
            n = len(w.seq.grants)
            (good if ok[offset : offset + n].all() else failed).append(w)
            offset += n
        return self._without_ended(good, failed), self._fail_all(failed)

    def _check_references(self, work: list[Work]) -> tuple[list[Work], list[Work]]:
        """L3 for shared pages: (work whose sequences hold every page they borrow or read shared, the rest)."""
        good: list[Work] = []
        failed: list[Work] = []
        for w in work:
            seq = w.seq
            reads = [i for i, page in enumerate(seq.page_ids) if i < seq.shared or page in self.pages.holders]
            ok = not reads or self.pages.held_by(seq.rid, seq.tags[0][reads], seq.tags[3][reads])
            (good if ok else failed).append(w)
        return self._without_ended(good, failed), failed

    def _without_ended(self, good: list[Work], failed: list[Work]) -> list[Work]:
        """``good`` less the choices of requests that one of ``failed`` ends."""
        ending = {self._rid(w.seq) for w in failed}
        return [w for w in good if self._rid(w.seq) not in ending]

    def _fail_all(self, failed: list[Work]) -> list[RequestOutput]:
        """Fail the requests of ``failed`` (once each, with every choice)."""
        outputs = []
        for w in failed:
            if w.seq.rid in self.seqs:
                outputs.append(self._fail(w.seq))
        return outputs

    def _check_writes(self, work: list[Work]) -> None:
        """No step writes K/V into a page another sequence reads (raises ``PageError``: a bug)."""
        for w in work:
            self.pages.check_writable(w.pages_written(self.config.page_size))

    def _stamp_new_grants(self, work: list[Work]) -> None:
        """Pages granted by the scheduler since the last step are filled by this engine: tag them as ours."""
        assert self.region is not None  # called only where remote writes land in a region
        for w in work:
            seq = w.seq
            if seq.stamped < len(seq.grants):
                self.region.stamp(*(part[seq.stamped:] for part in seq.tags))
                seq.stamped = len(seq.grants)

    def _fail(self, seq: Sequence) -> RequestOutput:
        """End ``seq``'s request, whose KV failed L3: ``seq``'s own pages are quarantined, the references it holds
        and its sibling choices' pages released."""
        log.error("request %032x: KV page tags do not match; failing it", seq.rid)
        rid = seq.rid
        self.scheduler.detach(seq)
        grants = seq.drop_grants()
        mine = [g for g in grants if self.pages.owner_of(g.page) == rid and g.page not in self.pages.holders]
        self.pages.quarantine(rid, mine, "tag mismatch")
        self.pages.free(rid, [g for g in grants if g not in mine and self.pages.holds(rid, g)])
        del self.seqs[rid], self.trackers[rid]
        for branch in self._live(seq):
            self._end(branch)
        err = IntegrityError("KV cache verification failed for this request; no output was produced.", layer="tags")
        return RequestOutput(self._rid(seq), [], "", FinishReason.ERROR, error=err)

    def _sample(self, work: list[Work], logits: torch.Tensor) -> list[RequestOutput]:
        for w in work:
            w.seq.num_computed = w.end
            self.prompt_tokens_computed += max(0, min(w.end, w.seq.req.prompt_len) - w.start)
        self._computed(work)
        for w in work:
            if w.start < w.seq.req.prompt_len == w.end:
                self._cache_prompt(w.seq)
        due = [i for i, w in enumerate(work) if w.samples]
        if not due:
            return []
        seqs = [work[i].seq for i in due]
        rows = logits if len(due) == len(work) else logits[due]  # [len(due), vocab]; no copy when all sample
        requests = [s.req for s in seqs]
        guides = [self.trackers[s.rid].guide for s in seqs]
        tokens = sample(rows, requests, [s.generator for s in seqs], self.tokenizer.eos_token_ids, guides)
        logprobs = token_logprobs(rows, requests, tokens)
        outputs: list[RequestOutput] = []
        for i, (seq, token, logprob) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
            if seq.group is not None and not seq.group.forked:
                outputs += self._fork(seq, [(token, logprob), *self._sample_branches(seq.group, rows[i])])
            elif (out := self._on_token(seq, token, logprob)) is not None:
                outputs.append(out)
        return outputs

    def _sample_branches(self, group: Group, row: torch.Tensor) -> list[tuple[int, TokenLogprob | None]]:
        """The first token of choices 1..n-1: each from the same logits ``row`` [vocab], with its own generator."""
        others = group.branches[1:]
        rows = row.expand(len(others), -1)  # [n-1, vocab], no copy
        requests = [b.req for b in others]
        guides = [t.guide for t in group.trackers[1:]]
        tokens = sample(rows, requests, [b.generator for b in others], self.tokenizer.eos_token_ids, guides)
        return list(zip(tokens, token_logprobs(rows, requests, tokens), strict=True))

    def _scores_prompt(self, w: Work) -> bool:
        """Whether ``w`` computes prompt positions whose next token's logprob its request asked for."""
        return w.seq.req.params.prompt_logprobs is not None and w.start < w.seq.req.prompt_len - 1

    def _score_prompts(self, work: list[Work], logits: torch.Tensor) -> torch.Tensor:
        """From every position's ``logits`` [sum(n), vocab]: record the prompt logprobs that were asked for (a
        position once; a preempted request recomputes), and return each chunk's last row [len(work), vocab]."""
        last, offset = [], 0
        for w in work:
            n = w.end - w.start
            if self._scores_prompt(w):
                req, scores = w.seq.req, self.trackers[w.seq.rid].prompt_logprobs
                top = req.params.prompt_logprobs
                assert top is not None  # _scores_prompt
                for pos in range(max(w.start, len(scores)), min(w.end, req.prompt_len - 1)):
                    scores.append(logprob_of(logits[offset + pos - w.start], req.prompt_ids[pos + 1], top))
            last.append(offset + n - 1)
            offset += n
        return logits[last]

    def _computed(self, work: list[Work]) -> None:
        """Hook: the K/V of every ``work`` item is now in the pool."""

    def _cache_prompt(self, seq: Sequence) -> None:
        """``seq`` computed its prompt: its full pages go to the prefix cache (``Scheduler.cache_prompt``)."""
        self.scheduler.cache_prompt(seq)

    def _on_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput | None:
        """Hook: ``seq`` sampled ``token``. Records it, and ends the choice when it is finished."""
        out = self.trackers[seq.rid].append(token, logprob)
        if len(seq.req.output_ids) == 1:
            out.cached_tokens = (seq.group.branches[0] if seq.group is not None else seq).cached
        if out.choice_finish is not None:
            self._end(seq, out)
        return out if seq.group is None else self._as_choice(seq, out)

    def _fork(self, seq: Sequence, firsts: list[tuple[int, TokenLogprob | None]]) -> list[RequestOutput]:
        """Hook: choice 0 (``seq``) computed the prompt and every choice sampled its first token (``firsts``).
        The other choices take the prompt's pages (all before any choice ends and releases its own), then each
        records its token."""
        group = seq.group
        assert group is not None  # only a request's choice 0 with n > 1 forks
        group.forked = True
        for branch, tracker in zip(group.branches[1:], group.trackers[1:], strict=True):
            self.seqs[branch.rid], self.trackers[branch.rid] = branch, tracker
            self._attach(seq, branch)
        outputs = (self._on_token(b, *first) for b, first in zip(group.branches, firsts, strict=True))
        return [out for out in outputs if out is not None]

    def _attach(self, seq: Sequence, branch: Sequence) -> None:
        """Give ``branch`` the prompt KV of ``seq``: its full pages by reference, its partial last page as a copy
        of its own (shared too when ``shared_write`` is off); the page bookkeeping is ``Scheduler.attach``.
        Without a free page for the copy, ``branch`` waits and recomputes the prompt."""
        copy = self.scheduler.attach(seq, branch, self.safety.shared_write)
        if copy is not None:
            self.pool.copy_page(*copy)

    def _as_choice(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        """``out`` of choice ``seq`` as its request's output: the request's id, tokens counted over every choice,
        and the request's end only once its last choice ends (with the grants every choice read)."""
        group = seq.group
        assert group is not None  # called for choices of a group only
        group.tokens += len(out.token_ids)
        out.rid, out.index, out.completion_tokens = group.rid, seq.index, group.tokens
        if seq.index:
            out.prompt_logprobs = None  # choice 0 carries them
        if out.choice_finish is not None:
            group.open -= 1
            group.pages += out.pages or []
            group.preemptions += out.preemptions
            out.pages, out.preemptions = (group.pages, group.preemptions) if not group.open else (None, 0)
            if group.open:
                out.finish_reason = None
        return out

    def _open(self, req: Request) -> Sequence:
        """Track ``req``: its sequence (choice 0), and with ``n`` > 1 its other choices, waiting to fork."""
        seq = Sequence(req, make_generator(req.params))
        self.seqs[req.rid] = seq
        self.trackers[req.rid] = self._tracker(req)
        if req.params.n > 1:
            reqs = [dataclasses.replace(req, rid=branch_rid(req.rid, i), output_ids=[])
                    for i in range(1, req.params.n)]
            others = [Sequence(r, make_generator(r.params, i), index=i) for i, r in enumerate(reqs, 1)]
            seq.group = Group(req.rid, [seq, *others], [self.trackers[req.rid], *map(self._tracker, reqs)],
                              open=req.params.n)
            for branch in others:
                branch.group = seq.group
        return seq

    def _tracker(self, req: Request) -> OutputTracker:
        return OutputTracker(req, self.tokenizer, self.token_limit, self._guide(req))

    def _live(self, seq: Sequence) -> list[Sequence]:
        """``seq``'s request's choices still tracked here (``seq`` alone without choices)."""
        branches = seq.group.branches if seq.group is not None else [seq]
        return [b for b in branches if self.seqs.get(b.rid) is b]

    @staticmethod
    def _rid(seq: Sequence) -> int:
        """The request ``seq`` belongs to."""
        return seq.group.rid if seq.group is not None else seq.rid

    def _end(self, seq: Sequence, last: RequestOutput | None = None) -> None:
        """Forget ``seq`` and free its pages; ``last`` (its final output) records the grants it read and how often
        it was preempted."""
        if last is not None:
            last.pages = [(g.page, g.epoch) for g in seq.grants]
            last.preemptions = seq.preemptions
        self.scheduler.remove(seq)
        del self.seqs[seq.rid], self.trackers[seq.rid]
