"""The process's memory around a model load: where the weights a decode step streams live, and what a long-lived
worker does once its model is built."""

from __future__ import annotations

import ctypes
import gc
import mmap

HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page


def huge_pages(nbytes: int) -> memoryview:
    """``nbytes`` (> 0) of zeroed private memory starting on a 2 MiB boundary, advised for transparent huge pages.

    A batch-1 decode step streams every weight (~100 MB for SmolLM2) from DRAM. On 4 KiB pages that is a TLB miss
    every 4 KiB, each a page walk (two-dimensional in a VM); on 2 MiB pages the whole stream needs ~50 entries.
    Where THP is ``madvise`` or ``always`` (``/sys/kernel/mm/transparent_hugepage/enabled``) the kernel backs this
    with huge pages; elsewhere (``never``, non-Linux) it is ordinary memory. The mapping lives as long as a view of
    the returned buffer does; untouched pages cost no memory."""
    if nbytes <= 0:
        raise ValueError(f"huge_pages needs a positive size, got {nbytes}")
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # + room to align
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mm)) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE, start, size)
    return memoryview(mm)[start : start + nbytes]


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
