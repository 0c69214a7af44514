"""The model checker's KV data plane: each decode page is a label, checked on landing by the real ``check_landing``.

A ``Label`` says who wrote a page last (its tag record) and whether its bytes were corrupted on the way. To
verify a landing, ``landing_problem`` renders the labels as a small real region (tag records, and per token
16 bytes that name the writer and the slot) and runs ``kvcache.layout.check_landing`` over it: tags (L3),
coverage (L4) and checksums (L5, per page and for the whole transfer), exactly as decode does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from kvfence.kvcache.layout import KVLayout, RegionView, check_landing
from kvfence.kvcache.pages import PageGrant
from kvfence.safety import Safety

STALE = 0xEE  # what a slot no write of the page's writer reached holds, as far as the checksum can tell


@dataclass(frozen=True)
class Label:
    """What a decode page holds: its tag record (who wrote it last), and whether its bytes still match it."""

    rid: int
    epoch: int
    page: int
    tokens: int
    corrupt: bool = False


ZEROS = Label(0, 0, 0, 0)  # a fresh region


@dataclass(frozen=True)
class Write:
    """One page of KV (and its tag) on its way into a decode pool."""

    rid: int
    page: int
    epoch: int
    tokens: int
    target: int  # the decode incarnation whose pool it writes into
    corrupt: bool = False


def _layout(pages: int, page_size: int) -> KVLayout:
    return KVLayout(pages, page_size, num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=8)  # 16 bytes a token


def kv_bytes(rid: int, page: int, tokens: int) -> bytes:
    """The KV that ``rid``'s writer puts in the first ``tokens`` slots of ``page``."""
    slots = [(rid & (2**64 - 1), page << 16 | slot) for slot in range(tokens)]
    return np.array(slots, dtype="<u8").tobytes()


def page_sum(rid: int, page: int, tokens: int) -> int:
    """The checksum a writer stamps in the tag record of the page it wrote."""
    return xxhash.xxh3_64_intdigest(kv_bytes(rid, page, tokens))


def region(plane: tuple[Label, ...], page_size: int) -> RegionView:
    """The labels as a real region: bytes and tag records."""
    layout = _layout(len(plane), page_size)
    view = RegionView(layout, memoryview(bytearray(layout.nbytes)))
    for page, label in enumerate(plane):
        data = np.frombuffer(kv_bytes(label.rid, label.page, label.tokens), dtype=np.uint8)
        view.pages[page, :] = STALE
        view.pages[page, :len(data)] = data
        if label.corrupt:
            view.pages[page, 0] ^= 0xFF
        view.write_tag(page, label.rid, label.epoch, label.page, label.tokens,
                       page_sum(label.rid, label.page, label.tokens))
    return view


def landing_problem(plane: tuple[Label, ...], page_size: int, safety: Safety, rid: int, grants: list[PageGrant],
                    expected_tokens: int, checksum: int) -> str | None:
    """Decode's landing check (``check_landing``, with ``safety``'s layers) over the modelled pool."""
    return check_landing(region(plane, page_size), rid, [(g.page, g.epoch) for g in grants], expected_tokens,
                         checksum, tags=safety.tags, coverage=safety.coverage, checksum=safety.checksum)
