"""Page bookkeeping: exact page ids, epochs, free order, ownership rules."""

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from kvfence.kvcache.layout import KVLayout, RegionView
from kvfence.kvcache.pages import OutOfPages, PageError, PageGrant, PageState, PageTable, _tag_check

pytestmark = pytest.mark.fast


A = 0xA000_0000_0000_0000_0000_0000_0000_0001  # 128-bit owners: the high half matters
B = 0xB000_0000_0000_0000_0000_0000_0000_0001


def tags(table: PageTable, owner: int, grants: list[PageGrant]):
    pages = np.array([g.page for g in grants], dtype=np.int64)
    n = len(grants)
    return (
        pages,
        np.full(n, owner >> 64, dtype=np.uint64),
        np.full(n, owner & (2**64 - 1), dtype=np.uint64),
        np.array([g.epoch for g in grants], dtype=np.uint64),
    )


def test_grant_order_and_epochs():
    t = PageTable(4)
    assert t.grant(A, 2) == [PageGrant(0, 1), PageGrant(1, 1)]
    assert t.grant(B, 1) == [PageGrant(2, 1)]
    assert (t.num_free, t.num_used) == (1, 3)
    t.check_integrity()


def test_free_is_fifo_and_regrant_bumps_epoch():
    t = PageTable(4)
    a = t.grant(A, 2)
    b = t.grant(B, 2)
    t.free(A, a[::-1])  # freed 1 then 0: they queue in that order
    assert t.grant(B, 2) == [PageGrant(1, 2), PageGrant(0, 2)]
    t.free(B, b)
    assert t.grant(A, 1) == [PageGrant(2, 2)]
    t.check_integrity()


def test_only_owner_may_free_and_double_free_raises():
    t = PageTable(2)
    a = t.grant(A, 1)
    with pytest.raises(PageError):
        t.free(B, a)
    t.free(A, a)
    with pytest.raises(PageError, match="double free"):
        t.free(A, a)
    t.check_integrity()


def test_stale_epoch_cannot_free_new_grant():
    t = PageTable(1)
    old = t.grant(A, 1)
    t.free(A, old)
    t.grant(A, 1)  # same page, same owner, epoch 2
    with pytest.raises(PageError):
        t.free(A, old)


def test_out_of_pages_raises_and_changes_nothing():
    t = PageTable(2)
    t.grant(A, 1)
    assert not t.can_grant(2)
    with pytest.raises(OutOfPages):
        t.grant(B, 2)
    assert t.num_free == 1
    t.check_integrity()


def test_quarantine_keeps_page_out_until_released():
    t = PageTable(2)
    a = t.grant(A, 2)
    t.quarantine(A, a[:1], "writer silent")
    t.free(A, a[1:])
    assert t.grant(B, 1) == [PageGrant(1, 2)]
    assert not t.can_grant(1)
    assert t.quarantine_reason == {0: "writer silent"}
    t.check_integrity()
    t.release_quarantine(0)
    assert t.grant(B, 1) == [PageGrant(0, 2)]
    t.check_integrity()


def test_verify_catches_wrong_owner_epoch_and_freed_pages():
    t = PageTable(3)
    a = t.grant(A, 2)
    assert t.verify(*tags(t, A, a)).all()
    assert not t.verify(*tags(t, B, a)).any()
    stale = [PageGrant(a[0].page, a[0].epoch - 1), a[1]]
    assert t.verify(*tags(t, A, stale)).tolist() == [False, True]
    t.free(A, a[1:])
    assert t.verify(*tags(t, A, a)).tolist() == [True, False]


def test_states_and_fill():
    t = PageTable(2)
    a = t.grant(A, 1)
    t.set_state(A, a, PageState.WRITING)
    t.set_filled(A, a[0], 16)
    assert (t.state[0], t.filled[0]) == (PageState.WRITING, 16)
    with pytest.raises(PageError):
        t.set_state(B, a, PageState.READY)
    t.free(A, a)
    assert t.filled[0] == 0


def test_integrity_check_detects_corruption():
    t = PageTable(3)
    t.grant(A, 1)
    t.state[1] = PageState.GRANTED  # a page both free-queued and held
    with pytest.raises(PageError):
        t.check_integrity()


def test_tag_check_in_c_builds_here():
    if shutil.which("cc") is None or not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        pytest.skip("no C compiler or Python headers: L3 takes the NumPy path")
    assert _tag_check() is not None


def test_all_held_answers_as_verify_and_the_tag_records_do():
    """L3's C fast path against the NumPy checks, over random tables with one field spoiled at a time: the page
    table's owner halves, epoch or state, a tag record's owner halves, epoch or page, or a page out of range."""
    if _tag_check() is None:
        pytest.skip("tag_check.c is not built here")
    layout = KVLayout(num_pages=24, page_size=4, num_layers=1, num_kv_heads=1, head_dim=4, dtype_bytes=2)
    rng = np.random.default_rng(7)
    spoils = ["table_hi", "table_lo", "table_epoch", "table_state", "tag_hi", "tag_lo", "tag_epoch", "tag_page",
              "range", None]
    for trial in range(300):
        table = PageTable(layout.num_pages)
        region = RegionView(layout, memoryview(bytearray(layout.nbytes)))
        owners = [int(rng.integers(1, 2**62)) << 64 | int(rng.integers(1, 2**62)) for _ in range(3)]
        seqs = []
        for owner in owners:
            grants = table.grant(owner, int(rng.integers(1, 7)))
            seq = tags(table, owner, grants)
            region.stamp(*seq)
            seqs.append(seq)
        spoil = spoils[trial % len(spoils)]
        pages, hi, lo, epochs = seqs[int(rng.integers(len(seqs)))]
        page = int(pages[int(rng.integers(len(pages)))])
        record = region.tags[page]
        match spoil:
            case "table_hi":
                table.owner_hi[page] ^= 1 << 63
            case "table_lo":
                table.owner_lo[page] ^= 1
            case "table_epoch":
                table.epoch[page] += 1
            case "table_state":
                table.state[page] = rng.choice([PageState.FREE, PageState.QUARANTINED])
            case "tag_hi":
                record["owner_hi"] ^= 1 << 62
            case "tag_lo":
                record["owner_lo"] ^= 2
            case "tag_epoch":
                record["epoch"] -= 1
            case "tag_page":
                record["page"] = (page + 1) % layout.num_pages
            case "range":
                pages[0] = layout.num_pages
        in_range = all(((s[0] >= 0) & (s[0] < layout.num_pages)).all() for s in seqs)
        want_table = in_range and all(table.verify(*s).all() for s in seqs)
        want_both = want_table and all(region.tags_match(*s).all() for s in seqs)
        assert table.all_held(seqs, None) == want_table, spoil
        assert table.all_held(seqs, region.tags) == want_both, spoil
        assert want_both == (spoil is None), spoil


def test_all_held_refuses_malformed_arguments():
    table = PageTable(4)
    if _tag_check() is None:
        pytest.skip("tag_check.c is not built here")
    grants = table.grant(A, 2)
    good = tags(table, A, grants)
    assert table.all_held([good], None)
    with pytest.raises(TypeError):
        table.all_held([good[:3]], None)  # not a 4-tuple
    with pytest.raises(ValueError):
        table.all_held([(good[0], good[1][:1], good[2], good[3])], None)  # lengths differ
    with pytest.raises(ValueError):
        table.all_held([good], np.zeros(3, dtype=np.uint8))  # tag records of the wrong size
    with pytest.raises(TypeError):
        table.all_held(None, None)


# -- sharing (n > 1 choices) ---------------------------------------------------------------------------------

C = 0xC000_0000_0000_0000_0000_0000_0000_0001


def test_a_shared_page_stays_allocated_until_its_last_holder_frees_it():
    t = PageTable(4)
    a = t.grant(A, 2)
    t.share(A, a, B)
    t.share(A, a[:1], C)
    assert [t.refcount(g.page) for g in a] == [3, 2]
    t.free(A, a)  # the owner leaves first: both pages stay, still tagged as A's
    assert (t.num_free, [t.refcount(g.page) for g in a], t.owner_of(0)) == (2, [2, 1], A)
    assert t.holds(B, a[1]) and not t.holds(A, a[1])
    t.check_integrity()
    t.free(B, a)
    assert (t.num_free, t.refcount(0), t.refcount(1)) == (3, 1, 0)
    t.free(C, a[:1])
    assert t.num_free == 4 and not t.holders
    t.check_integrity()


def test_a_released_reference_cannot_be_freed_again_nor_read():
    t = PageTable(2)
    a = t.grant(A, 1)
    t.share(A, a, B)
    t.free(B, a)
    with pytest.raises(PageError):
        t.free(B, a)
    assert not t.held_by(B, *tags(t, A, a)[::3])
    assert t.held_by(A, *tags(t, A, a)[::3])
    t.share(A, a, B)
    t.free(A, a)
    with pytest.raises(PageError, match="already released"):
        t.free(A, a)  # A still owns the page (its tags name A), but no longer holds it
    assert not t.held_by(A, *tags(t, A, a)[::3]) and t.held_by(B, *tags(t, A, a)[::3])


def test_only_a_holder_shares_and_only_once():
    t = PageTable(2)
    a = t.grant(A, 1)
    with pytest.raises(PageError):
        t.share(B, a, C)  # B holds nothing
    t.share(A, a, B)
    with pytest.raises(PageError):
        t.share(A, a, B)
    t.set_state(A, a, PageState.WRITING)
    with pytest.raises(PageError, match="being written"):
        t.share(A, a, C)  # a transfer may still land in it


def test_writing_into_a_page_with_several_holders_is_refused():
    t = PageTable(3)
    a = t.grant(A, 2)
    t.check_writable([0, 1])
    t.share(A, a[:1], B)
    t.check_writable([1])
    with pytest.raises(PageError, match="read-only"):
        t.check_writable([1, 0])
    t.free(A, a[:1])  # B is its only holder now: B may write
    t.check_writable([0])


def test_a_shared_page_cannot_be_quarantined():
    t = PageTable(2)
    a = t.grant(A, 1)
    t.share(A, a, B)
    with pytest.raises(PageError, match="shared"):
        t.quarantine(A, a, "test")
    t.free(B, a)
    t.quarantine(A, a, "test")
    t.check_integrity()
