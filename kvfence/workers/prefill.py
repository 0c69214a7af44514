"""The prefill worker: computes prompts and writes their KV, with tags, into decode workers' pages.

One thread owns everything: the ZeroMQ channel, the protocol core, and a
``PrefillRunner`` (the engine, computing into this worker's own pool and
shipping each page to decode as soon as its tokens are computed, so
transfers overlap the next chunk's compute).

The prefix cache lives here, in this worker's own pool: a hit skips computing
those tokens, but every page of the prompt, cached or computed, is still
written into decode's pages with its tag, so decode verifies exactly what it
verifies without the cache.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace

from kvfence.core import Request, ServiceUnavailable, TokenLogprob
from kvfence.engine.engine import Engine
from kvfence.engine.scheduler import Sequence, Work
from kvfence.kvcache.layout import TAG_BYTES, KVLayout, tokens_per_page, transfer_checksum
from kvfence.protocol.actions import StartPrefill
from kvfence.protocol.executor import Computed, PrefillExecutor
from kvfence.protocol.messages import DecodeSide, Hello, Peers, PrefillSide
from kvfence.protocol.prefill import PrefillCore, PrefillLimits
from kvfence.transfer.base import KVInitiator, PeerHandle, Segment
from kvfence.workers.common import WorkerBase, WorkerSettings

log = logging.getLogger(__name__)

SETTLE_S = 0.25  # a step waits this long at most for the writes of the prompts it finished
DRAIN_POLL_S = 0.005  # with only writes in flight, the loop checks its inbox this often


@dataclass
class Shipment:
    """One prompt on its way to decode: where it goes and what is in flight."""

    start: StartPrefill
    peer: PeerHandle
    dest: KVLayout  # the decode pool's layout (its tag records follow its own pages)
    shipped: int = 0  # pages sent so far
    sums: list[int] = field(default_factory=list)
    futures: list[Future] = field(default_factory=list)
    firsts: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # each choice's first token
    prompt_logprobs: list[TokenLogprob] | None = None
    cached: int = 0  # prompt tokens read from the prefix cache
    stopped: bool = False

    def drained(self) -> bool:
        return all(f.done() for f in self.futures)

    def error(self) -> BaseException | None:
        return next((f.exception() for f in self.futures if f.exception() is not None), None)


class PrefillRunner(Engine):
    """An engine that stops each request after its first token and ships its pages instead of decoding.

    A request's local pages stay held until every write reading them has finished. A page's tag record is
    staged in its own tag slot before it ships; a cached page shipped for several requests at once has one slot,
    so a shipment waits until the previous one that staged a record there has finished.
    """

    decodes = False

    def __init__(self, *args, initiator: KVInitiator, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.initiator = initiator
        self.shipments: dict[int, Shipment] = {}
        self.draining: dict[int, Sequence] = {}
        self.progressed: dict[int, int] = {}  # rid -> prompt tokens computed, for prompts that advanced this step
        self.staged: dict[int, Future] = {}  # local page -> the latest write whose tag record was staged in its slot

    @property
    def token_limit(self) -> int:
        """A prompt may fill the whole pool: prefill stores the prompt's KV, never the sampled token's."""
        return min(self.config.max_context, self.config.num_pages * self.config.page_size) + 1

    def start(self, start: StartPrefill, req: Request, peer: PeerHandle, dest: KVLayout) -> None:
        self.add(req)
        self.shipments[req.rid] = Shipment(start, peer, dest)

    def stop(self, rid: int) -> None:
        """Stop computing ``rid``; it is reported by ``finished`` once its writes have drained."""
        seq = self.seqs.get(rid)
        ship = self.shipments.get(rid)
        if seq is None or ship is None:
            return
        ship.stopped = True
        if rid not in self.draining:
            self._detach(seq)

    def finished(self) -> list[tuple[Shipment, int, BaseException | None]]:
        """Shipments whose writes have all drained: (shipment, tokens, error). Frees their local pages."""
        done = []
        for rid, seq in list(self.draining.items()):
            ship = self.shipments[rid]
            if ship.drained():
                del self.draining[rid], self.shipments[rid], self.seqs[rid], self.trackers[rid]
                self.pages.free(rid, seq.drop_grants())
                done.append((ship, seq.req.prompt_len, ship.error()))
        return done

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the writes of prompts that finished computing, so that their ``Done`` leaves
        with this step rather than after the next one (a step can take a second; a write takes milliseconds).
        Writes of prompts still computing keep overlapping the compute."""
        wait([f for rid in self.draining for f in self.shipments[rid].futures], timeout=timeout)

    def _computed(self, work: list[Work]) -> None:
        for w in work:
            self._ship(w.seq, final=False)
            self.progressed[w.seq.rid] = w.end

    def _on_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        self._fork(seq, [(token, logprob)])

    def _fork(self, seq: Sequence, firsts: list[tuple[int, TokenLogprob | None]]) -> list:
        """The prompt is computed and every choice has its first token: ship the last page; decode forks."""
        ship = self.shipments[seq.rid]
        ship.firsts, ship.cached = firsts, seq.cached
        if seq.req.params.prompt_logprobs is not None:
            ship.prompt_logprobs = self.trackers[seq.rid].prompt_logprobs
        self._ship(seq, final=True)
        self._detach(seq)
        return []

    def _detach(self, seq: Sequence) -> None:
        """Out of the scheduler, pages still held: they are being read by transfers."""
        self.scheduler.detach(seq)
        self.draining[seq.rid] = seq

    def _ship(self, seq: Sequence, final: bool) -> None:
        """Write every newly completed page (and, when final, the last partial one) with its tag."""
        ship = self.shipments[seq.rid]
        ps, n = self.config.page_size, seq.req.prompt_len
        upto = len(seq.grants) if final else seq.num_computed // ps
        if upto <= ship.shipped:
            return
        region, layout = self.pool.region, self.pool.layout
        assert region is not None  # a prefill pool lies on the data plane's region
        counts = tokens_per_page(n, ps, len(seq.grants))
        pages = [g.page for g in seq.grants[ship.shipped : upto]]
        wait([self.staged[p] for p in pages if p in self.staged])
        self.pool.to_host(pages)
        segments: list[Segment] = []
        for i in range(ship.shipped, upto):
            src = seq.grants[i].page
            dst, epoch = ship.start.dest[i]
            tokens = counts[i]
            checksum = region.page_checksum(src, tokens)
            region.write_tag(src, seq.rid, epoch, dst, tokens, checksum)
            ship.sums.append(checksum)
            segments += [(layout.page_offset(src), ship.dest.page_offset(dst), tokens * layout.token_bytes),
                         (layout.tag_offset(src), ship.dest.tag_offset(dst), TAG_BYTES)]
        ship.shipped = upto
        future = self.initiator.submit(ship.peer, _merge(segments))
        ship.futures.append(future)
        self.staged.update(dict.fromkeys(pages, future))


def _merge(segments: list[Segment]) -> list[Segment]:
    """Coalesce segments that are adjacent on both sides."""
    out: list[Segment] = []
    for src, dst, n in sorted(segments):
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((src, dst, n))
    return out


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        from kvfence.transfer.base import make_initiator

        config, timeouts = settings.engine, settings.timeouts
        self.initiator = make_initiator(settings.transfer, self.layout().nbytes,
                                        **settings.data_plane_options("initiator"))
        self.runner = PrefillRunner(self.loaded.model, self.loaded.tokenizer, config, self.dtype,
                                    pool=self.make_pool(self.initiator.buffer), initiator=self.initiator)
        limits = PrefillLimits(config.max_context, config.kv_pool_tokens, config.page_size, timeouts.wait,
                               orphan_dest_timeout=timeouts.orphan_dest)
        self.core = PrefillCore(self.me, settings.router, limits, self.safety, settings.emulate_incident)
        self.peers = Peers({})  # the decode workers' data planes, as the router last sent them
        self._executor = PrefillExecutor(self.core, self, self.channel, time.monotonic)

    @property
    def engine(self) -> Engine:
        return self.runner

    @property
    def executor(self) -> PrefillExecutor:
        return self._executor

    def close(self) -> None:
        super().close()
        self.initiator.close()

    def hello(self) -> Hello:
        sched = self.runner.scheduler
        queued = sum(s.req.prompt_len - s.num_computed for s in (*sched.waiting, *sched.running))
        pages, cache = self.runner.pages, self.runner.cache
        return Hello(self.me, self.me, PrefillSide(self.peers.digest()), self.settings.engine.kv_pool_tokens,
                     self.settings.engine.max_context, free_pages=self.runner.free_pages, queued_tokens=queued,
                     running=len(sched.running), pid=os.getpid(), quarantined_pages=pages.num_quarantined,
                     quarantine_reasons=pages.quarantine_reasons(),
                     total_pages=pages.num_pages, cpu=self.cpu,
                     backend=self.backend, prompt_tokens_computed=self.runner.prompt_tokens_computed,
                     cached_pages=len(cache.entries) if cache else 0, cache_evictions=cache.evictions if cache else 0,
                     safety_off=self.safety.disabled)

    def step(self) -> None:
        if self.runner.has_work:
            self.runner.step()
            for rid, tokens in self.runner.progressed.items():
                self._executor.progress(rid, tokens)
            self.runner.progressed.clear()
            self.runner.settle(SETTLE_S)
        else:  # only writes draining: wait for them a little instead of spinning on a shared core
            self.runner.settle(DRAIN_POLL_S)
        self._executor.collect()

    def has_work(self) -> bool:
        return self.runner.has_work or bool(self.runner.draining)

    def tidy(self) -> None:
        super().tidy()
        self.initiator.trim()  # decode's pool stops counting in this process's RSS until the next write

    # -- PrefillEnv: what the executor acts on -------------------------------------------

    def start(self, start: StartPrefill) -> None:
        req = start.msg
        assert req is not None  # the prefill core's StartPrefill carries the router's Prefill
        request = Request(start.prompt_ids, req.params.to_sampling().with_max_tokens(1), req.tenant, rid=start.rid,
                          weight=req.weight, cache_salt=req.cache_salt, public_tokens=req.public_tokens)
        decode = self.peers.decodes[start.decode]
        dest = dest_layout(self.runner.pool.layout, decode)
        peer = self.initiator.connect(decode.target)
        self.runner.start(start, request, peer, dest)

    def stop(self, rid: int) -> None:
        self.runner.stop(rid)

    def finished(self) -> list[Computed]:
        done: list[Computed] = []
        for ship, tokens, err in self.runner.finished():
            rid = ship.start.rid
            if err is not None:
                log.warning("request %032x: KV transfer to %s failed: %s", rid, ship.start.decode, err)
                done.append(Computed(rid, error=ServiceUnavailable(f"KV transfer failed: {err}")))
            else:
                done.append(Computed(rid, tokens, transfer_checksum(ship.sums), ship.firsts or [(0, None)],
                                     ship.prompt_logprobs, ship.cached))
        if done and not self.runner.draining:  # a shipment ended and none is in flight: the pages of decode's
            self.initiator.trim()  # pool this process wrote stop counting in its RSS (the next write faults them back:
            # ~1 ms per 5 MB, under 1% of the prefill that wrote them)
        return done


def dest_layout(local: KVLayout, decode: DecodeSide) -> KVLayout:
    """The layout of the pool ``decode`` names: ours, with its page count; its size must agree."""
    dest = replace(local, num_pages=decode.kv_pages)
    if dest.nbytes != decode.target.nbytes:
        raise ServiceUnavailable(f"decode KV region is {decode.target.nbytes} bytes, {dest.nbytes} expected: "
                                 "prefill and decode must serve the same model, dtype and page size")
    return dest

