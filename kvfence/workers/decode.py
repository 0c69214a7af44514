"""The decode worker: owns the KV pool prefill writes into, verifies each landing, decodes and streams.

Its pool lives in the region a transfer backend registered (``KVTarget``),
so prefill workers write pages and tags straight into it. One thread owns
the channel, the protocol core and the engine; the core and the engine's
scheduler share one page table.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from kvfence.core import FinishReason, Request, RequestOutput
from kvfence.engine.engine import Engine
from kvfence.faults import flip_one_byte
from kvfence.kvcache.layout import check_landing
from kvfence.kvcache.pages import PageGrant
from kvfence.protocol.actions import StartDecode
from kvfence.protocol.decode import DecodeCore, DecodeLimits
from kvfence.protocol.executor import DecodeExecutor
from kvfence.protocol.messages import DecodeSide, ErrorInfo, Hello, Output, Reject
from kvfence.workers.common import WorkerBase, WorkerSettings

log = logging.getLogger(__name__)

# Sharing its cores with a prefill worker (``WorkerSettings.solo_threads``), decode gives them to the prompts on
# their way to it: after a step taken while one is pending it pauses PREFILL_YIELD times that step, at most
# MAX_PAUSE_S. A burst of prompts then prefills on every core, and running streams still advance at a bounded pace.
PREFILL_YIELD = 4.0
MAX_PAUSE_S = 0.1


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        from kvfence.transfer.base import make_target

        config, timeouts = settings.engine, settings.timeouts
        self.target = make_target(settings.transfer, self.layout().nbytes, **settings.data_plane_options("target"))
        self._engine = Engine(self.loaded.model, self.loaded.tokenizer, config, self.dtype,
                              pool=self.make_pool(self.target.buffer), safety=self.safety, remote_writes=True)
        limits = DecodeLimits(config.max_context, config.page_size, timeouts.handoff, abort_timeout=timeouts.abort,
                              page_wait_timeout=timeouts.wait, fair=config.fair)
        self.core = DecodeCore(self.me, settings.router, self._engine.pages, limits, self.safety, self._verify)
        self._executor = DecodeExecutor(self.core, self, self.channel, time.monotonic)
        self.verified: dict[int, str] = {}  # rid -> how its landing was verified, for its last Output
        self.flip_random = self.faults.rng("flip") if self.faults and self.faults.flip else None
        self.paused_after_step = 0.0  # see PREFILL_YIELD
        self.shared_threads = torch.get_num_threads()  # its share while a prefill works for it

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def executor(self) -> DecodeExecutor:
        return self._executor

    def close(self) -> None:
        super().close()
        self.target.close()

    def check_integrity(self) -> None:
        self._engine.check_integrity(self.core.granted_pages())

    def hello(self) -> Hello:
        sched, pages = self._engine.scheduler, self._engine.pages
        side = DecodeSide(self.target.descriptor(), pages.num_pages)
        return Hello(self.me, self.me, side, self.settings.engine.kv_pool_tokens,
                     self.settings.engine.max_context, free_pages=self._engine.free_pages,
                     queued_tokens=len(self.core.waiting), running=len(sched.running), pid=os.getpid(),
                     quarantined_pages=pages.num_quarantined,
                     quarantine_reasons=pages.quarantine_reasons(), total_pages=pages.num_pages, cpu=self.cpu,
                     backend=self.backend, prompt_tokens_computed=self._engine.prompt_tokens_computed,
                     safety_off=self.safety.disabled)

    def paused_until(self) -> float:
        """Yielding to a prefill worker on the same cores: the pause ends early once no prefill works for this one."""
        return self.paused_after_step if self.settings.solo_threads and self.core.prefill_pending() else 0.0

    def step(self) -> None:
        """One engine step on every core (``solo_threads``) while no prefill works for this worker, else on its
        share of them, then a pause (``paused_until``). The bits are the same on any thread count (tested)."""
        solo, shared = self.settings.solo_threads, self.core.prefill_pending()
        if solo:
            self.loaded.model.backend.set_threads(self.shared_threads if shared else solo)
        start = time.monotonic()
        outputs = self._engine.step()
        if solo and shared:
            now = time.monotonic()
            self.paused_after_step = now + min(PREFILL_YIELD * (now - start), MAX_PAUSE_S)
        self._executor.outputs([self.to_message(out) for out in outputs])
        if outputs and self.faults and self.faults.slow_step:
            time.sleep(self.faults.slow_step)

    # -- DecodeEnv: what the executor acts on -------------------------------------------

    def start(self, start: StartDecode) -> list[Output | Reject]:
        a, done = start.admit, start.done
        req = Request(a.prompt_ids, a.params.to_sampling(), a.tenant, rid=a.rid, weight=a.weight)
        self._engine.pool.from_host([g.page for g in start.grants])  # verified: what landed is what decodes
        outs = self._engine.add_prefilled(req, start.grants, done.firsts(), done.prompt_logprobs, done.cached_tokens)
        return [self.to_message(out) for out in outs]

    def stop(self, rid: int) -> None:
        self._engine.abort(rid)
        self.verified.pop(rid, None)

    def _verify(self, rid: int, grants: list[PageGrant], expected_tokens: int, checksum: int) -> str | None:
        s = self.safety
        if self.flip_random is not None and self.faults is not None and self.flip_random.random() < self.faults.flip:
            self._flip_landed_byte(grants[0].page, min(expected_tokens, self.settings.engine.page_size))
        region = self._engine.pool.region
        assert region is not None  # a decode pool lies on the data plane's region
        problem = check_landing(region, rid, [(g.page, g.epoch) for g in grants], expected_tokens,
                                checksum, tags=s.tags, coverage=s.coverage, checksum=s.checksum)
        if problem is None:
            skipped = [layer for layer in ("tags", "coverage", "checksum") if layer in s.disabled]
            self.verified[rid] = f"ok (skipped: {', '.join(skipped)})" if skipped else "ok"
        return problem

    def _flip_landed_byte(self, page: int, tokens: int) -> None:
        """Fault injection: corrupt one byte of what landed in ``page``, as a faulty link or NIC would."""
        layout = self._engine.pool.layout
        assert self.flip_random is not None  # called only where KVFENCE_FAULTS flips bytes
        offset = flip_one_byte(self.target.buffer, layout.page_offset(page), tokens * layout.token_bytes,
                               self.flip_random)
        log.warning("KVFENCE_FAULTS: flipped byte %d of landed page %d", offset, page)

    def to_message(self, out: RequestOutput) -> Output | Reject:
        """The engine's output as a message; the last one carries its pages and how they were verified."""
        if out.error is not None:
            self.verified.pop(out.rid, None)
            return Reject(out.rid, ErrorInfo.of(out.error), self.me)
        finish = out.finish_reason.value if isinstance(out.finish_reason, FinishReason) else None
        verification = self.verified.pop(out.rid, None) if finish else None
        choice_finish = out.choice_finish.value if isinstance(out.choice_finish, FinishReason) else None
        return Output(out.rid, out.token_ids, out.text, finish, out.prompt_tokens, out.completion_tokens,
                      out.pages, verification, out.preemptions, logprobs=out.logprobs,
                      prompt_logprobs=out.prompt_logprobs, index=out.index, choice_finish=choice_finish,
                      cached_tokens=out.cached_tokens)

