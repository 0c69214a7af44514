"""Page bookkeeping: exact page ids, epochs, free order, ownership rules."""

import numpy as np
import pytest

from kvfence.kvcache.pages import OutOfPages, PageError, PageGrant, PageState, PageTable

A = 0xA000_0000_0000_0000_0000_0000_0000_0001  # 128-bit owners: the high half matters
B = 0xB000_0000_0000_0000_0000_0000_0000_0001


def tags(table: PageTable, owner: int, grants: list[PageGrant]):
    pages = np.array([g.page for g in grants])
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
