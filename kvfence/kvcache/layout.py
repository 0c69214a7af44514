"""Byte layout of a KV region (a worker's pool plus its page tags), and the tag records.

A region is ``num_pages`` pages followed by ``num_pages`` 64-byte tag
records. Inside a page tokens come first: ``[page_size, layers, 2 (K,V),
kv_heads, head_dim]``, so the first ``n`` tokens of a page are one
contiguous run of bytes and a transfer moves exactly what was written.

A tag record says who wrote a page and what: owner (the 128-bit request id),
the epoch of the decode-side grant, the page it was meant for, the token
count, and the xxh3-64 of those tokens' bytes. Prefill writes the record next
to the page; decode checks it when the transfer lands (L3, L4, L5).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from kvfence.config import ModelConfig

TAG_BYTES = 64
TAG_DTYPE = np.dtype([
    ("owner_hi", "<u8"), ("owner_lo", "<u8"), ("epoch", "<u8"), ("page", "<u4"), ("tokens", "<u4"),
    ("checksum", "<u8"), ("pad", "V24"),
])
assert TAG_DTYPE.itemsize == TAG_BYTES


@dataclass(frozen=True)
class KVLayout:
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @classmethod
    def of(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype_bytes: int) -> KVLayout:
        return cls(num_pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype_bytes)

    @property
    def token_bytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.token_bytes

    @property
    def tags_offset(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def nbytes(self) -> int:
        return self.tags_offset + self.num_pages * TAG_BYTES

    def page_offset(self, page: int) -> int:
        return page * self.page_bytes

    def tag_offset(self, page: int) -> int:
        return self.tags_offset + page * TAG_BYTES


class RegionView:
    """NumPy views of one region's pages (as bytes) and tag records."""

    def __init__(self, layout: KVLayout, buffer: memoryview) -> None:
        if len(buffer) < layout.nbytes:
            raise ValueError(f"KV region needs {layout.nbytes} bytes, buffer has {len(buffer)}")
        self.layout = layout
        raw = np.frombuffer(buffer, dtype=np.uint8, count=layout.nbytes)
        self.pages = raw[: layout.tags_offset].reshape(layout.num_pages, layout.page_bytes)
        self.tags = raw[layout.tags_offset :].view(TAG_DTYPE)

    def page_checksum(self, page: int, tokens: int) -> int:
        # numpy's stubs give ndarray its buffer protocol (__buffer__) only on Python >= 3.12
        return xxhash.xxh3_64_intdigest(self.pages[page, : tokens * self.layout.token_bytes])  # type: ignore[arg-type]

    def write_tag(self, slot: int, owner: int, epoch: int, page: int, tokens: int, checksum: int) -> None:
        tag = self.tags[slot]
        tag["owner_hi"], tag["owner_lo"] = owner >> 64, owner & (2**64 - 1)
        tag["epoch"], tag["page"], tag["tokens"], tag["checksum"] = epoch, page, tokens, checksum


    def stamp(self, pages: np.ndarray, owner_hi: np.ndarray, owner_lo: np.ndarray, epochs: np.ndarray) -> None:
        """Name the owner grant in the tag records of ``pages`` (pages their owner fills itself)."""
        tags = self.tags
        tags["owner_hi"][pages], tags["owner_lo"][pages], tags["epoch"][pages] = owner_hi, owner_lo, epochs
        tags["page"][pages] = pages

    def tags_match(self, pages: np.ndarray, owner_hi: np.ndarray, owner_lo: np.ndarray,
                   epochs: np.ndarray) -> np.ndarray:
        """Vectorised: a bool per page, True where its tag record names this owner, epoch and page."""
        tags = self.tags[pages]
        ok: np.ndarray = tags["owner_hi"] == owner_hi
        ok &= tags["owner_lo"] == owner_lo
        ok &= tags["epoch"] == epochs
        ok &= tags["page"] == pages
        return ok


def transfer_checksum(page_checksums: list[int]) -> int:
    """One checksum for a whole transfer: xxh3-64 over its pages' checksums in order."""
    return xxhash.xxh3_64_intdigest(np.array(page_checksums, dtype="<u8").tobytes())


def tokens_per_page(total: int, page_size: int, num_pages: int) -> list[int]:
    """How many tokens each of ``num_pages`` pages holds when ``total`` tokens fill them in order."""
    return [max(0, min(page_size, total - i * page_size)) for i in range(num_pages)]


def check_landing(view: RegionView, rid: int, grants: list[tuple[int, int]], expected_tokens: int,
                  claimed_checksum: int, *, tags: bool, coverage: bool, checksum: bool) -> str | None:
    """Decode's check of a finished transfer into ``grants``; None when it is good, else what is wrong,
    prefixed with the layer that caught it ("tags: ...", "coverage: ...", "checksum: ...")."""
    hi, lo = rid >> 64, rid & (2**64 - 1)
    sums = []
    for (page, epoch), tokens in zip(grants, tokens_per_page(expected_tokens, view.layout.page_size, len(grants)),
                                     strict=True):
        tag = view.tags[page]
        if tags and (int(tag["owner_hi"]), int(tag["owner_lo"]), int(tag["epoch"]), int(tag["page"])) != \
                (hi, lo, epoch, page):
            return f"tags: page {page}: tag does not name this request and grant (epoch {epoch})"
        if coverage and int(tag["tokens"]) != tokens:
            return f"coverage: page {page}: {int(tag['tokens'])} tokens written, {tokens} expected"
        if checksum:
            actual = view.page_checksum(page, tokens)
            if actual != int(tag["checksum"]):
                return f"checksum: page {page}: checksum mismatch"
            sums.append(actual)
    if checksum and transfer_checksum(sums) != claimed_checksum:
        return "checksum: transfer checksum mismatch"
    return None
