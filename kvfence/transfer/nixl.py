"""``nixl``: NVIDIA NIXL (``nixl-cu12``, installed ``--no-deps`` beside CPU torch), UCX backend, DRAM registration.

Each side runs one ``nixl_agent`` with the UCX backend and registers its
region as DRAM. The target's descriptor carries its agent metadata (UCX
worker address and the region's remote keys, base64) and the region's
address; the initiator loads it with ``add_remote_agent``, then per write
creates a WRITE request from two descriptor lists, posts it and polls it until
it succeeds. It does so through the agent's bindings (``nixlAgent``), which the
Python ``nixl_agent`` wraps with checks and conversions that cost ~1.8 us per
write (a quarter of a 64 KiB write). A NIXL/UCX WRITE succeeds only after a
flush, i.e. once the data is in the remote memory. On one host UCX moves the
bytes with shared-memory transports (CMA), between hosts over TCP or RDMA
(steer with ``UCX_TLS``).

NIXL itself rejects a range outside the target's registered memory, and a
vanished peer surfaces as NIXL_ERR_REMOTE_DISCONNECT (or our deadline).

Caveat: a target's graceful ``close`` reaches connected initiators as an
asynchronous disconnect message; a write racing it can still land, since on
one host UCX writes by CMA straight into the live target process. Only the
target process's exit (or that message) stops writes. Don't close a pool
that may still be written to; quarantine its pages instead.
"""

from __future__ import annotations

import base64
import functools
import importlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np

from kvfence.descriptors import Descriptor, NixlDescriptor
from kvfence.transfer.base import (
    DEFAULT_TIMEOUT,
    KVInitiator,
    KVTarget,
    PeerHandle,
    Plan,
    Region,
    TransferError,
    TransferTimeout,
)

PROGRESS_DELAY_US = 1000  # NIXL progress thread: sleep on UCX events, waking at least every 1 ms
_YIELD_EVERY = 256  # polls between deadline checks and GIL yields
_SMALL_LIST = 16  # segments below which a list of tuples beats NumPy
_api_module: ModuleType | None = None
_patch_lock = threading.Lock()


def _api() -> ModuleType:
    """``nixl._api``. The per-CUDA wheels are imported directly: the ``nixl`` meta package
    imports torch (about a second) just to learn that a CPU build has no CUDA."""
    global _api_module
    if _api_module is None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
            try:
                _api_module = importlib.import_module(name)
                break
            except ModuleNotFoundError:
                continue
        else:
            raise ImportError("no NIXL Python package (nixl_cu12, nixl_cu13 or nixl) is installed")
    return _api_module


def probe() -> tuple[bool, str]:
    try:
        _api()
    except ImportError as e:
        return False, f"cannot import NIXL ({e}); install it with `pip install --no-deps nixl-cu12 nixl`"
    return True, ""


def _agent(prefix: str, backends: tuple[str, ...], progress_thread: bool) -> tuple[Any, str]:
    """A NIXL agent with ``backends`` created (thread-safe mode: several threads may write at once).

    Targets need a progress thread (UCX wire-up, disconnects, and the data itself
    over network transports); initiators drive UCX by polling their transfers.
    """
    api = _api()
    name = f"kvfence-{prefix}-{uuid.uuid4().hex}"
    conf = api.nixl_agent_config(
        enable_prog_thread=progress_thread,
        backends=list(backends),
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    try:
        with _progress_delay(api, PROGRESS_DELAY_US):
            agent = api.nixl_agent(name, conf)
    except Exception as e:
        raise TransferError(f"NIXL agent failed to start: {e}") from e
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise TransferError(f"NIXL backend(s) {missing} unavailable; plugins found: {agent.plugin_list}")
    return agent, name


@contextmanager
def _progress_delay(api: ModuleType, delay_us: int) -> Iterator[None]:
    """Create agents with ``pthrDelay = delay_us`` while in this block.

    ``nixl_agent`` hard-codes ``pthrDelay = 0``, and the UCX progress thread then
    ``poll()``s its workers' event fds with a zero timeout: it spins a core even
    when idle (half of this 2-core machine per process). Any delay > 0 makes it
    sleep on those fds, woken by traffic and at least every ceil(delay) ms.
    """
    bind = api.nixlBind
    make = bind.nixlAgent

    def with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return make(name, config)

    with _patch_lock:
        bind.nixlAgent = with_delay
        try:
            yield
        finally:
            bind.nixlAgent = make


def _register(agent: Any, region: Region) -> Any:
    try:
        return agent.register_memory([(region.address, region.nbytes, 0, "")], "DRAM")
    except Exception as e:
        raise TransferError(f"NIXL could not register {region.nbytes} bytes of DRAM: {e}") from e


class Target(KVTarget):
    """Options: ``backends`` (default ``("UCX",)``)."""

    kind = "nixl"

    def __init__(self, nbytes: int, backends: tuple[str, ...] = ("UCX",)) -> None:
        self.region = Region.anonymous(nbytes)
        self.buffer = self.region.buffer
        self.nbytes = nbytes
        self._agent, self.name = _agent("target", backends, progress_thread=True)
        self._reg = _register(self._agent, self.region)

    def descriptor(self) -> NixlDescriptor:
        metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
        return NixlDescriptor(nbytes=self.nbytes, agent=self.name, metadata=metadata, base=self.region.address)

    def close(self) -> None:
        """Deregister the region and drop the agent (its UCX worker goes with it)."""
        if self._agent is None:
            return
        self._agent.deregister_memory(self._reg)
        self._agent = self._reg = None
        self.region.close()


class NixlPeer(PeerHandle):
    def __init__(self, descriptor: NixlDescriptor, remote_name: Any) -> None:
        super().__init__(descriptor)
        self.agent = descriptor.agent
        self.remote_name = remote_name
        self.base = descriptor.base


class Initiator(KVInitiator):
    """Options: ``backends`` (default ``("UCX",)``), ``timeout`` (seconds per write)."""

    kind = "nixl"

    def __init__(self, nbytes: int, backends: tuple[str, ...] = ("UCX",), timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(nbytes, timeout)
        self._agent, self.name = _agent("initiator", backends, progress_thread=False)
        self._reg = _register(self._agent, self.region)
        bind = _api().nixlBind
        self._core = self._agent.agent  # the bound nixlAgent; requests are plain integer handles
        self._dlist = functools.partial(bind.nixlXferDList, self._agent.nixl_mems["DRAM"])
        self._write_op = self._agent.nixl_ops["WRITE"]
        self._success, self._in_progress = bind.NIXL_SUCCESS, bind.NIXL_IN_PROG
        self._stuck: list[int] = []  # requests NIXL could not cancel: released again at close, never reused

    def _connect(self, descriptor: Descriptor) -> PeerHandle:
        assert isinstance(descriptor, NixlDescriptor)  # connect checked the kind
        try:
            remote = self._agent.add_remote_agent(base64.b64decode(descriptor.metadata))
            self._agent.make_connection(remote)
        except Exception as e:
            raise TransferError(f"NIXL could not connect to {descriptor.agent}: {e}") from e
        return NixlPeer(descriptor, remote)

    def _descs(self, base: int, plan: Plan, column: int) -> Any:
        """A DRAM transfer list of (base + offset, nbytes) for the plan's source (0) or destination (1) column."""
        if len(plan) == 1:
            return self._dlist([(base + plan[0][column], plan[0][2], 0)])
        if len(plan) <= _SMALL_LIST:
            return self._dlist([(base + seg[column], seg[2], 0) for seg in plan])
        a = np.array(plan, dtype=np.uint64)
        rows = np.zeros((len(plan), 3), dtype=np.uint64)  # (address, length, device id)
        rows[:, 0], rows[:, 1] = a[:, column] + np.uint64(base), a[:, 2]
        return self._dlist(rows)

    def _write(self, peer: PeerHandle, plan: Plan, deadline: float) -> None:
        """Create the WRITE request, post it and poll it to a final status, then release it.

        The initiator has no progress thread: the polls drive UCX (on one host each
        one copies by CMA), so poll without sleeping, but let other Python threads
        run now and then.
        """
        assert isinstance(peer, NixlPeer)
        if not plan:
            return
        core, in_progress = self._core, self._in_progress
        try:
            local = self._descs(self.region.address, plan, 0)
            remote = self._descs(peer.base, plan, 1)
            request = core.createXferReq(self._write_op, local, remote, peer.remote_name, b"", [])
        except Exception as e:
            raise TransferError(f"NIXL rejected the write to {peer.agent}: {e}") from e
        try:
            status = core.postXferReq(request, b"")
            polls = 0
            while status == in_progress:
                polls += 1
                if polls % _YIELD_EVERY == 0:
                    if time.monotonic() > deadline:
                        raise TransferTimeout("NIXL write timed out")
                    time.sleep(0)
                status = core.getXferStatus(request)
        except Exception as e:
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"NIXL write to {peer.agent} failed: {e}") from e
        finally:
            self._release_request(request)
        if status != self._success:
            raise TransferError(f"NIXL write to {peer.agent} ended with status {status}")

    def _release_request(self, request: int) -> None:
        try:
            self._core.releaseXferReq(request)
        except Exception:
            self._stuck.append(request)  # still in flight and not cancellable: must outlive its transfer

    def _disconnect(self, peer: PeerHandle) -> None:
        assert isinstance(peer, NixlPeer)
        try:
            self._agent.remove_remote_agent(peer.remote_name)
        except Exception:
            pass  # already gone

    def _release(self) -> None:
        stuck, self._stuck = self._stuck, []
        for request in stuck:
            self._release_request(request)
        self._agent.deregister_memory(self._reg)
        self._agent = self._reg = self._core = None
