"""KV tensor storage: one preallocated region of pages (see ``layout.py``).

``data`` is ``[num_pages, page_size, num_layers, 2, kv_heads, head_dim]``
(token-major pages; index 0/1 of dim 3 is K/V). The region may live in
memory a transfer backend registered (decode's pool is written by prefill
workers). Storage is never scrubbed: a freed page keeps whatever its last
owner wrote, and only the page table says whose it is now.
"""

from __future__ import annotations

import mmap

import torch

from kvfence.config import ModelConfig
from kvfence.kvcache.layout import KVLayout, RegionView

_TORCH_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", buffer: memoryview | None = None, staged: bool | None = None
                 ) -> None:
        """Pages on ``buffer`` (CPU bytes, e.g. a transfer backend's region) or on fresh memory of ``device``.

        ``staged`` (the default where ``buffer`` and a GPU meet): the model's pages ``data`` live on ``device`` and
        the region on ``buffer`` mirrors them only where ``to_host`` / ``from_host`` copy pages across, which a
        worker does before its pages leave (prefill) and after they land and pass verification (decode).
        """
        self.num_pages, self.page_size = num_pages, page_size
        self.layout = KVLayout.of(cfg, num_pages, page_size, _TORCH_BYTES[dtype])
        shape = (num_pages, page_size, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
        on_cpu = torch.device(device).type == "cpu"
        if buffer is None and on_cpu:
            buffer = memoryview(mmap.mmap(-1, self.layout.nbytes))  # page-aligned, lazily backed
        self.region: RegionView | None = None
        self.host: torch.Tensor | None = None
        if buffer is not None:
            self.region = RegionView(self.layout, buffer)
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=self.layout.tags_offset)
            self.host = raw.view(dtype).view(shape)
        self.staged = self.host is not None and (not on_cpu if staged is None else staged)
        self.data = self.host if self.host is not None and not self.staged else torch.empty(shape, dtype=dtype,
                                                                                           device=device)

    def to_host(self, pages: list[int]) -> None:
        """Copy ``pages`` from ``data`` into the region (staged pools; otherwise they are the same bytes)."""
        if self.staged and pages:
            assert self.host is not None  # staged pools have a region
            idx = torch.tensor(pages)
            self.host.index_copy_(0, idx, self.data.index_select(0, idx.to(self.data.device)).cpu())

    def from_host(self, pages: list[int]) -> None:
        """Copy ``pages`` from the region into ``data`` (staged pools; otherwise they are the same bytes)."""
        if self.staged and pages:
            assert self.host is not None  # staged pools have a region
            idx = torch.tensor(pages)
            self.data.index_copy_(0, idx.to(self.data.device), self.host.index_select(0, idx).to(self.data.device))

    def copy_page(self, src: int, dst: int, tokens: int) -> None:
        """Copy the first ``tokens`` slots of page ``src`` into page ``dst`` (copy-on-fork of a prompt's partial
        last page: each branch then writes its own tokens into its own copy)."""
        self.data[dst, :tokens] = self.data[src, :tokens]  # [tokens, layers, 2, kvh, hd]

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[T, kv_heads, head_dim]`` of ``layer`` for T tokens at (page, offset) pairs."""
        self.data[pages, offsets, layer] = torch.stack((k, v), dim=1)  # [T, 2, kvh, hd]

    def read(self, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[length, kv_heads, head_dim]`` of one sequence holding ``pages`` (in order)."""
        kv = self.data[pages, :, layer]  # [np, page_size, 2, kvh, hd]
        kv = kv.reshape(-1, *kv.shape[2:])[:length]  # [length, 2, kvh, hd]
        return kv[:, 0], kv[:, 1]

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes
