"""KV pool storage and the region layout: where bytes go, and tag records."""

import pytest
import torch

from kvfence.config import ModelConfig
from kvfence.kvcache.layout import KVLayout, RegionView, check_landing, tokens_per_page, transfer_checksum
from kvfence.kvcache.pool import KVPool

pytestmark = pytest.mark.fast


CFG = ModelConfig("llama", 10, 8, 16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, rope_theta=1e4,
                  rms_norm_eps=1e-5, max_context=64, tie_word_embeddings=True)
RID = (7 << 64) | 9


def test_write_then_read_returns_tokens_in_sequence_order():
    pool = KVPool(CFG, num_pages=4, page_size=2, dtype=torch.float32)
    pages = torch.tensor([3, 1])  # a sequence holding pages 3 then 1
    k = torch.arange(3 * 4, dtype=torch.float32).view(3, 1, 4)
    pool.write(1, pages[torch.tensor([0, 0, 1])], torch.tensor([0, 1, 0]), k, -k)
    got_k, got_v = pool.read(1, pages, 3)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert torch.equal(pool.data[1, 0, 1, 0], k[2])  # token 2 sits in page 1, slot 0, layer 1, K


def test_a_page_prefix_is_contiguous_bytes_in_the_region():
    pool = KVPool(CFG, num_pages=2, page_size=4, dtype=torch.bfloat16)
    layout = pool.layout
    assert layout.token_bytes == 2 * 2 * 1 * 4 * 2
    pool.data[1, 0] = 1.0
    raw = pool.region.pages[1]
    assert raw[: layout.token_bytes].any() and not raw[layout.token_bytes :].any()


def test_landing_check_catches_each_kind_of_fault():
    layout = KVLayout.of(CFG, num_pages=4, page_size=2, dtype_bytes=4)
    view = RegionView(layout, memoryview(bytearray(layout.nbytes)))
    grants = [(2, 5), (0, 6)]
    view.pages[2, :] = 1
    view.pages[0, :] = 2
    sums = []
    for (page, epoch), n in zip(grants, tokens_per_page(3, 2, 2), strict=True):
        sums.append(view.page_checksum(page, n))
        view.write_tag(page, RID, epoch, page, n, sums[-1])
    good = dict(tags=True, coverage=True, checksum=True)
    assert check_landing(view, RID, grants, 3, transfer_checksum(sums), **good) is None
    assert "tag" in check_landing(view, RID + 1, grants, 3, transfer_checksum(sums), **good)
    assert "tag" in check_landing(view, RID, [(2, 4), (0, 6)], 3, transfer_checksum(sums), **good)
    assert "expected" in check_landing(view, RID, grants, 4, transfer_checksum(sums), **good)
    assert "transfer checksum" in check_landing(view, RID, grants, 3, transfer_checksum(sums) ^ 1, **good)
    view.write_tag(0, RID, 6, 3, 1, sums[1])  # the second page's record names another destination page
    assert check_landing(view, RID, grants, 3, transfer_checksum(sums), **good).startswith("tags: page 0")
    view.write_tag(0, RID, 6, 0, 1, sums[1])
    view.pages[0, 0] ^= 0xFF  # a flipped byte inside the written tokens
    assert "checksum" in check_landing(view, RID, grants, 3, transfer_checksum(sums), **good)
    off = dict(tags=False, coverage=False, checksum=False)
    assert check_landing(view, RID + 1, grants, 4, 0, **off) is None


def test_a_staged_pool_mirrors_the_region_only_where_pages_are_copied():
    """With the model's pages on a GPU (``staged``; forced here on CPU), the region sees a page only after
    ``to_host``, and the model only after ``from_host``: prefill ships what it computed, decode reads what landed."""
    layout = KVLayout.of(CFG, num_pages=4, page_size=2, dtype_bytes=4)
    pool = KVPool(CFG, 4, 2, torch.float32, buffer=memoryview(bytearray(layout.nbytes)), staged=True)
    assert pool.data.data_ptr() != pool.host.data_ptr()
    pool.data[1] = 1.0
    pool.data[2] = 2.0
    assert not pool.region.pages[1].any()
    pool.to_host([2])
    assert torch.equal(pool.host[2], pool.data[2]) and not pool.host[1].any()
    pool.host[3] = 3.0  # a transfer lands in page 3
    pool.from_host([3, 2])
    assert torch.equal(pool.data[3], pool.host[3]) and torch.equal(pool.data[1], torch.ones_like(pool.data[1]))
    unstaged = KVPool(CFG, 4, 2, torch.float32, buffer=memoryview(bytearray(layout.nbytes)))
    assert unstaged.data.data_ptr() == unstaged.host.data_ptr()  # on CPU the pool is the region itself
