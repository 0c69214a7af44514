"""Every environment variable kvfence reads, in one place. Each is read when its accessor is called, so a test
may set one and the next caller sees it.

``openmp_defaults`` is the one place kvfence writes the environment for the libraries it loads: the CLI calls it
before torch (and with it libgomp) is imported, and the worker processes it spawns inherit it.

The data planes also set the log level of the libraries they load (``MC_LOG_LEVEL``, ``NIXL_LOG_LEVEL``) and
mooncake's own settings; those are the libraries' variables, not kvfence's.

| variable | read by | meaning |
|---|---|---|
| ``KVFENCE_UNSAFE`` | ``safety.Safety.from_env`` | safety layers switched off, for tests (``layer,...`` or ``all``) |
| ``KVFENCE_FAULTS`` | ``faults.Faults.from_env`` | injected control-plane faults (``drop=P,dup=P,...``) |
| ``KVFENCE_CLUSTER_KEY`` | ``cluster.key_from`` | the cluster key file, where ``--cluster-key`` is not given |
| ``KVFENCE_CPU`` | ``model.kernels`` | caps the C kernels' flavour: ``auto``, ``amx``, ``avx512``, ``avx2``, ``none`` |
| ``KVFENCE_KEEP_BLOCKS`` | ``model.llama`` | ``0``: expand GGUF block weights to the model dtype at load |
| ``KVFENCE_PREFILL_ATTENTION`` | ``model.backends.c`` | ``0``: prefill attention on torch instead of the C kernel |
| ``KVFENCE_DECODE_INT8`` | ``model.backends.c`` | ``0``: no int8 decode rows |
| ``KVFENCE_TAG_CHECK_C`` | ``kvcache.pages`` | ``0``: L3's tag check in NumPy only (no C fast path) |
| ``KVFENCE_SHM_C`` | ``transfer.shm`` | ``0``: shm copies in NumPy only (no C copy) |
| ``KVFENCE_CACHE_DIR`` | ``cbuild`` | where built C kernels are kept (else under ``$XDG_CACHE_HOME`` or ``~/.cache``) |
| ``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY`` | ``openmp_defaults`` | kept if set; else ``GOMP_SPINCOUNT`` is set |
| ``KVFENCE_<FLAG>`` | ``cli.defaults_from_env`` | the default of the flag ``--<flag>`` (``flag_default``) |
"""

from __future__ import annotations

import os


def _text(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def _on(name: str) -> bool:
    """A switch that is on unless set to ``0``."""
    return _text(name, "1") != "0"


def unsafe() -> str:
    return _text("KVFENCE_UNSAFE")


def faults() -> str:
    return _text("KVFENCE_FAULTS")


def cluster_key_file() -> str | None:
    return _text("KVFENCE_CLUSTER_KEY") or None


def cpu() -> str:
    return _text("KVFENCE_CPU", "auto").strip().lower() or "auto"


def keep_blocks() -> bool:
    return _on("KVFENCE_KEEP_BLOCKS")


def prefill_attention() -> bool:
    return _on("KVFENCE_PREFILL_ATTENTION")


def decode_int8() -> bool:
    return _on("KVFENCE_DECODE_INT8")


def tag_check_c() -> bool:
    return _on("KVFENCE_TAG_CHECK_C")


def shm_c() -> bool:
    return _on("KVFENCE_SHM_C")


def cache_dir() -> str | None:
    return _text("KVFENCE_CACHE_DIR") or None


def flag_default(name: str) -> str | None:
    """``KVFENCE_<FLAG>``: the default of a command-line flag, None when unset (the command line wins)."""
    return os.environ.get(name)


def xdg_cache_home() -> str | None:
    return _text("XDG_CACHE_HOME") or None


# Iterations an OpenMP thread spins (each a PAUSE, ~40-150 cycles) at a barrier or between parallel regions
# before it sleeps: ~0.1-0.2 ms, longer than the gaps between a forward's kernel calls. libgomp's default
# (300,000: 10-20 ms) lets a waiting thread burn its whole time slice when the host has more runnable threads than
# cores, while the thread it waits for is not running: a 2,005-token prefill on a loaded 2-core host took 5-15 s
# instead of ~1.2 s (docs/performance.md, "OpenMP waits").
OPENMP_SPIN_COUNT = 3000


def openmp_defaults() -> None:
    """Make OpenMP threads spin briefly, then sleep, unless the user chose (``GOMP_SPINCOUNT`` or
    ``OMP_WAIT_POLICY`` set). Takes effect only before libgomp loads (torch's import loads it)."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


def c_compiler() -> str:
    return _text("CC", "cc")
