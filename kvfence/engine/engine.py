"""The colocated engine: scheduler + model + KV pool, one step at a time.

Not thread-safe: one thread owns an ``Engine`` and calls ``add``, ``abort``
and ``step``; ``local.py`` puts it behind an async interface.
"""

from __future__ import annotations

import logging

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
)
from kvfence.engine.grammar import Guide, ll_tokenizer
from kvfence.engine.output import OutputTracker
from kvfence.engine.sampler import logprob_of, make_generator, sample, token_logprobs
from kvfence.engine.scheduler import Scheduler, Sequence, Work
from kvfence.kvcache.pages import PageError, PageGrant, PageState, PageTable
from kvfence.kvcache.pool import KVPool
from kvfence.model.batch import SeqChunk
from kvfence.model.llama import Model
from kvfence.model.tokenizer import Tokenizer
from kvfence.safety import Safety

log = logging.getLogger(__name__)


class Engine:
    """Scheduler + model + KV pool.

    Before every step reads its pages, each page's owner and epoch are checked against the page table
    (L3). With ``remote_writes`` (decode: other processes write into this pool) the pages' tag records are
    checked too, so a late write from an earlier grant is caught before its bytes are read; the engine then
    stamps the tag records of pages it fills itself.
    """

    decodes = True  # requests decode here: the model prepares for decode rows at start (not at the first one)

    def __init__(self, model: Model, tokenizer: Tokenizer, config: EngineConfig, dtype: torch.dtype,
                 device: str = "cpu", pool: KVPool | None = None, safety: Safety | None = None,
                 remote_writes: bool = False) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.safety = safety or Safety.from_env()
        self.pool = pool or KVPool(model.config, config.num_pages, config.page_size, dtype, device)
        self.region = self.pool.region if remote_writes else None
        self.pages = PageTable(config.num_pages)
        self.scheduler = Scheduler(config, self.pages)
        self.seqs: dict[int, Sequence] = {}
        self.trackers: dict[int, OutputTracker] = {}
        if self.decodes:
            model.backend.prepare_decode_rows()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

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
        seq = Sequence(req, make_generator(req.params))
        self.seqs[req.rid] = seq
        self.trackers[req.rid] = OutputTracker(req, self.tokenizer, self.token_limit, self._guide(req))
        self.scheduler.add(seq)

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

    def add_prefilled(self, req: Request, grants: list[PageGrant], first_token: int,
                      first_logprob: TokenLogprob | None = None,
                      prompt_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """Take over a request whose prompt KV already sits, verified, in ``grants``; continue decoding.

        The pages must be held by ``req.rid`` in this engine's page table.
        """
        seq = Sequence(req, make_generator(req.params))
        seq.add_grants(grants)
        seq.num_computed = req.prompt_len
        seq.stamped = len(grants)  # prefill wrote these tag records, checked on landing
        self.seqs[req.rid] = seq
        self.trackers[req.rid] = OutputTracker(req, self.tokenizer, self.token_limit, self._guide(req))
        self.scheduler.add_running(seq)
        self.trackers[req.rid].prompt_logprobs = prompt_logprobs or []
        out = self.trackers[req.rid].append(first_token, first_logprob)
        if out.finished:
            self._end(seq, out)
        return out

    def abort(self, rid: int) -> RequestOutput | None:
        """Drop a request wherever it is and free its pages; None if it is unknown or already ended."""
        seq = self.seqs.get(rid)
        if seq is None:
            return None
        self._end(seq)
        return RequestOutput(rid, [], "", FinishReason.ABORT, prompt_tokens=seq.req.prompt_len,
                             completion_tokens=len(seq.req.output_ids))

    def step(self) -> list[RequestOutput]:
        """Schedule, verify, compute and sample one batch; return what each request produced."""
        work = self.scheduler.schedule()
        if not work:
            return []
        work, outputs = self._verify(work)
        if work:
            scored = any(self._scores_prompt(w) for w in work)
            logits = self.model.forward([self._chunk(w) for w in work], self.pool, all_logits=scored)
            if scored:
                logits = self._score_prompts(work, logits)
            outputs += self._sample(work, logits)
        return outputs

    def check_integrity(self, also_held: list[int] = ()) -> None:
        """The page table is consistent, and the pages it says are held are exactly those of live requests
        (plus ``also_held``: pages other owners on this thread hold, e.g. grants awaiting a transfer)."""
        self.pages.check_integrity()
        held = sorted([g.page for s in self.seqs.values() for g in s.grants] + list(also_held))
        state = self.pages.state
        table = np.flatnonzero((state >= PageState.GRANTED) & (state <= PageState.READY)).tolist()
        if held != table:
            raise PageError(f"pages held by the table ({len(table)}) differ from pages held by live requests "
                            f"({len(held)})")

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
        return good, [self._fail(w.seq) for w in failed]

    def _stamp_new_grants(self, work: list[Work]) -> None:
        """Pages granted by the scheduler since the last step are filled by this engine: tag them as ours."""
        for w in work:
            seq = w.seq
            if seq.stamped < len(seq.grants):
                self.region.stamp(*(part[seq.stamped:] for part in seq.tags))
                seq.stamped = len(seq.grants)

    def _fail(self, seq: Sequence) -> RequestOutput:
        log.error("request %032x: KV page tags do not match; failing it", seq.rid)
        rid = seq.rid
        self.scheduler.running.remove(seq)
        self.pages.quarantine(rid, [g for g in seq.drop_grants() if self.pages.owner_of(g.page) == rid], "tag mismatch")
        del self.seqs[rid], self.trackers[rid]
        err = IntegrityError("KV cache verification failed for this request; no output was produced.", layer="tags")
        return RequestOutput(rid, [], "", FinishReason.ERROR, error=err)

    def _sample(self, work: list[Work], logits: torch.Tensor) -> list[RequestOutput]:
        for w in work:
            w.seq.num_computed = w.end
        self._computed(work)
        due = [i for i, w in enumerate(work) if w.samples]
        if not due:
            return []
        seqs = [work[i].seq for i in due]
        rows = logits if len(due) == len(work) else logits[due]  # [len(due), vocab]; no copy when all sample
        requests = [s.req for s in seqs]
        guides = [self.trackers[s.rid].guide for s in seqs]
        tokens = sample(rows, requests, [s.generator for s in seqs], self.tokenizer.eos_token_ids, guides)
        logprobs = token_logprobs(rows, requests, tokens)
        outputs = (self._on_token(*args) for args in zip(seqs, tokens, logprobs, strict=True))
        return [out for out in outputs if out is not None]

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
                for pos in range(max(w.start, len(scores)), min(w.end, req.prompt_len - 1)):
                    scores.append(logprob_of(logits[offset + pos - w.start], req.prompt_ids[pos + 1],
                                             req.params.prompt_logprobs))
            last.append(offset + n - 1)
            offset += n
        return logits[last]

    def _computed(self, work: list[Work]) -> None:
        """Hook: the K/V of every ``work`` item is now in the pool."""

    def _on_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput | None:
        """Hook: ``seq`` sampled ``token``. Records it, and ends the request when it is finished."""
        out = self.trackers[seq.rid].append(token, logprob)
        if out.finished:
            self._end(seq, out)
        return out

    def _end(self, seq: Sequence, last: RequestOutput | None = None) -> None:
        """Forget ``seq`` and free its pages; ``last`` (its final output) records the grants it read and how often
        it was preempted."""
        if last is not None:
            last.pages = [(g.page, g.epoch) for g in seq.grants]
            last.preemptions = seq.preemptions
        self.scheduler.remove(seq)
        del self.seqs[seq.rid], self.trackers[seq.rid]
