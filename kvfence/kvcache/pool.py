"""KV tensor storage: one preallocated tensor each for K and V.

Layout: ``[num_layers, num_pages * page_size, num_kv_heads, head_dim]``; the
token at position ``p`` of a sequence lives in slot
``page_ids[p // page_size] * page_size + p % page_size``. Storage is never
scrubbed: a freed page keeps whatever its last owner wrote.
"""

from __future__ import annotations

import torch

from kvfence.config import ModelConfig


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str = "cpu") -> None:
        self.num_pages, self.page_size = num_pages, page_size
        shape = (cfg.num_layers, num_pages * page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    def slots(self, page_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of positions [start, end) for a sequence holding ``page_ids``."""
        ps = self.page_size
        pages = torch.tensor(page_ids, dtype=torch.long)
        pos = torch.arange(start, end)
        return pages[pos // ps] * ps + pos % ps

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
