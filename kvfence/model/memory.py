"""The process's memory around a model load: what a long-lived worker does once its model is built."""

from __future__ import annotations

import ctypes
import gc


def freeze_loaded_objects() -> None:
    """``gc.freeze()``: the objects alive now (a loaded model, its tokenizer: ~180k) leave the collector's view, so
    a full collection in a serving loop stops walking them (one took several ms, a stall in a 4 ms decode step).
    For long-lived processes only: anything frozen that later becomes cyclic garbage is never collected."""
    gc.collect()
    gc.freeze()


def release_free_memory() -> None:
    """``gc.collect()``, then glibc's ``malloc_trim(0)``: free heap pages go back to the OS (no glibc: no trim).

    Dequantizing leaves hundreds of MB of freed float32 temporaries in the heap, which RSS counts until trimmed.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass
