"""What prefill and decode workers share: settings, model and pool setup, and the IO loop.

The loop is the only place that touches sockets: it hands received messages
and timer ticks to the role's executor (``protocol/executor.py``), which feeds
the protocol core and carries out the actions that come back, and runs engine
steps. A ``Fenced`` from the router (it declared this worker dead while it was
paused or stuck) makes the worker drop every request it holds and say Hello
again under the new epoch (the executor does it).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time

import torch
import zmq

from kvfence.channel import Channel, HandshakeWatch, connect_push
from kvfence.engine.engine import Engine
from kvfence.faults import Faults
from kvfence.kvcache.layout import KVLayout
from kvfence.kvcache.pool import KVPool
from kvfence.model import kernels
from kvfence.protocol.executor import DecodeExecutor, PrefillExecutor
from kvfence.protocol.messages import Hello, encode_message
from kvfence.safety import Safety
from kvfence.workers.settings import WorkerSettings

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
HELLO_WAIT_S = 0.2  # the heartbeat waits this long for the loop's fresh Hello (a longer step: it sends the last one)
TICK_S = 0.05
TIDY_AFTER_S = 1.0  # idle this long, a worker tidies its memory (``WorkerBase.tidy``)


class WorkerBase:
    role = ""

    def __init__(self, settings: WorkerSettings) -> None:
        from kvfence.model.loader import load_model
        from kvfence.model.memory import freeze_loaded_objects

        self.settings = settings
        self.safety = Safety.from_env()
        self.faults = Faults.from_env()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.dtype = getattr(torch, settings.dtype)
        self.loaded = load_model(settings.model, dtype=self.dtype, device=settings.device)
        freeze_loaded_objects()
        self.cpu = kernels.detect().summary() if self.loaded.model.device.type == "cpu" else ""  # for Hello
        self.backend = self.loaded.model.backend.name  # for Hello
        self.channel = Channel(settings.bind, settings.advertise, self.faults, settings.cluster_key)
        self.me = self.channel.me
        self.stop_requested = False

    def request_stop(self, *_: object) -> None:
        """Leave the loop after the current step (a signal handler): ``run_forever`` returns, then ``close``."""
        self.stop_requested = True

    def close(self) -> None:
        """Let go of what outlives the process unless released: the channel, and each role's data plane (decode's
        shm segment stays in the tmpfs until unlinked)."""
        self.channel.close()

    # -- setup helpers --------------------------------------------------------------

    def layout(self) -> KVLayout:
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        engine = self.settings.engine
        return KVLayout.of(self.loaded.config, engine.num_pages, engine.page_size, dtype_bytes)

    def make_pool(self, buffer: memoryview) -> KVPool:
        engine = self.settings.engine
        return KVPool(self.loaded.config, engine.num_pages, engine.page_size, self.dtype, self.settings.device,
                      buffer=buffer)

    # -- what each role provides ------------------------------------------------------

    @property
    def engine(self) -> Engine:
        raise NotImplementedError

    @property
    def executor(self) -> PrefillExecutor | DecodeExecutor:
        """Feeds the role's protocol core and carries out its actions (``protocol/executor.py``)."""
        raise NotImplementedError

    def hello(self) -> Hello:
        raise NotImplementedError

    def step(self) -> None:
        """One engine step; what it produced goes to the core through the executor."""
        raise NotImplementedError

    def has_work(self) -> bool:
        return self.engine.has_work

    def paused_until(self) -> float:
        """A ``time.monotonic()`` before which the loop takes no step although there is work (it still receives)."""
        return 0.0

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def tidy(self) -> None:
        """Once the worker has idled for ``TIDY_AFTER_S``: give the heap's free pages (a batch's buffers) back to
        the OS, so an idle deployment's memory reads what it holds."""
        from kvfence.model.memory import release_free_memory

        release_free_memory()

    # -- the loop -------------------------------------------------------------------

    def run_forever(self) -> None:
        banner = self.safety.banner()
        if banner:
            print(banner, file=sys.stderr, flush=True)
        key = self.settings.cluster_key
        log.info("%s worker %s ready (pool %d tokens, transfer %s, %s)", self.role, self.me,
                 self.settings.engine.kv_pool_tokens, self.settings.transfer,
                 f"cluster {key.fingerprint}" if key else "no cluster key: loopback only")
        caveat = self.settings.data_plane_caveat()
        if caveat:
            log.warning(caveat)
        self._latest_hello = self.hello()
        self._hello_wanted, self._hello_fresh = threading.Event(), threading.Event()
        threading.Thread(target=self._heartbeat, name="kvfence-heartbeat", daemon=True).start()
        next_tick = 0.0
        idle_since: float | None = None  # when the worker last ran out of work; None while it works
        tidied = False
        while not self.stop_requested:
            now = time.monotonic()
            work, resume = self.has_work(), self.paused_until()
            wait = min(TICK_S, max(0.0, resume - now)) if work else TICK_S
            for env in self.channel.receive(math.ceil(wait * 1000)):
                self.executor.receive(env.sender, env.msg)
            if self.has_work():
                if self.paused_until() <= time.monotonic():
                    self.step()
                idle_since = None
            elif idle_since is None:
                self.check_integrity()  # idle: every held page belongs to a live request
                idle_since, tidied = now, False
            elif not tidied and now - idle_since >= TIDY_AFTER_S:
                self.tidy()
                tidied = True
            if now >= next_tick:
                self.executor.tick()
                next_tick = now + TICK_S
            if self._hello_wanted.is_set():  # made on demand: ~50 us, a percent of a batch-1 step
                self._hello_wanted.clear()
                self._latest_hello = self.hello()
                self._hello_fresh.set()
        log.info("%s worker %s stopping", self.role, self.me)

    def _heartbeat(self) -> None:
        """Say Hello to the router every HEARTBEAT_S from a thread of its own, so a long step never looks like death.
        The loop makes each Hello when asked, between steps; a step longer than HELLO_WAIT_S leaves it the last one.

        Uses its own socket: ZeroMQ sockets are not thread-safe. It also says (throttled) why
        the router refuses this worker, should it (``HandshakeWatch``).
        """
        sock = connect_push(zmq.Context.instance(), self.settings.router, self.settings.cluster_key)
        watch = HandshakeWatch(sock, "router")
        while True:
            watch.check()
            self._hello_fresh.clear()
            self._hello_wanted.set()
            self._hello_fresh.wait(HELLO_WAIT_S)
            try:
                sock.send(encode_message(self.me, self._latest_hello, self.channel.epoch), zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(HEARTBEAT_S)
