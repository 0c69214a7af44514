"""The prefix cache alone (``kvcache/prefix.py``) over a real ``PageTable``: keys, hand-over, references, LRU
eviction, epochs after eviction, and the integrity check of cache-held pages. Exact page ids, as vLLM's block
manager tests."""

import numpy as np
import pytest

from kvfence.kvcache.pages import PageError, PageGrant, PageState, PageTable
from kvfence.kvcache.prefix import PrefixCache

pytestmark = pytest.mark.fast


PS = 4
A, B = 0xA, 0xB  # request ids


def cache(pages: int = 8, scoped: bool = True) -> PrefixCache:
    return PrefixCache(PageTable(pages), PS, "model", scoped)


def computed(c: PrefixCache, rid: int, tokens: list[int], tenant: str = "alice") -> tuple[bytes, list[PageGrant]]:
    """``rid`` computes ``tokens`` into pages of its own and hands the full ones to the cache."""
    grants = c.pages.grant(rid, -(-len(tokens) // PS))
    scope = c.scope(tenant, None)
    keys = c.keys(scope, tokens)
    assert c.insert(keys, c.page_owners(scope, len(keys)), rid, grants[: len(keys)]) == len(keys)
    return scope, grants


def check(c: PrefixCache) -> None:
    c.pages.check_integrity(c.held, c.owners)


def test_a_key_names_the_tenant_the_salt_the_model_and_every_token_before_the_page():
    c = cache()
    tokens = list(range(10))  # two full pages, and two tokens that are never keyed
    alice = c.keys(c.scope("alice", None), tokens)
    assert len(alice) == 2 and all(len(k) == 16 for k in alice)
    assert alice == c.keys(c.scope("alice", None), tokens[:8])
    assert c.keys(c.scope("bob", None), tokens)[0] != alice[0]
    assert len({c.keys(c.scope("alice", salt), tokens)[0] for salt in (None, "", "s1", "s2")}) == 4
    assert c.keys(PrefixCache(PageTable(8), PS, "other").scope("alice", None), tokens)[0] != alice[0]
    changed = c.keys(c.scope("alice", None), [99] + tokens[1:])
    assert changed[0] != alice[0] and changed[1] != alice[1]  # a chain: page 1's key covers page 0's tokens
    assert c.owner(c.scope("alice", None)) != c.owner(c.scope("bob", None))


def test_without_scope_every_tenant_and_salt_shares_the_keys():
    c = cache(scoped=False)
    assert c.keys(c.scope("alice", "x"), [1] * 8) == c.keys(c.scope("bob", None), [1] * 8)


def test_insert_hands_the_pages_to_the_cache_owner_and_the_request_keeps_a_reference():
    c = cache()
    scope, grants = computed(c, A, list(range(10)))  # pages 0, 1 full; page 2 partial
    owner = c.owner(scope)
    assert [c.pages.owner_of(p) for p in (0, 1, 2)] == [owner, owner, A]
    assert [c.pages.refcount(p) for p in (0, 1, 2)] == [2, 2, 1]
    assert [int(c.pages.epoch[p]) for p in (0, 1)] == [g.epoch for g in grants[:2]]  # no new epoch
    assert c.held == {0: owner, 1: owner}
    check(c)
    c.pages.free(A, grants)
    assert c.pages.num_free == 6 and [c.pages.refcount(p) for p in (0, 1)] == [1, 1]
    check(c)


def test_a_match_is_the_longest_run_of_cached_keys_and_a_lend_takes_references():
    c = cache()
    scope, grants = computed(c, A, list(range(8)))
    keys = c.keys(scope, list(range(8)) + [50, 51, 52, 53])
    hit = c.match(keys)
    assert hit == grants[:2]
    assert c.match(c.keys(scope, [99] + list(range(1, 12)))) == []  # page 0 differs: nothing after it matches
    assert c.match(c.keys(c.scope("bob", None), list(range(8)))) == []
    assert c.lend(hit, B) == [c.owner(scope)] * 2
    assert [c.pages.refcount(p) for p in (0, 1)] == [3, 3]
    assert all(c.pages.holds(B, g) for g in hit)
    check(c)


def test_insert_stops_at_a_page_already_cached():
    c = cache()
    scope, _ = computed(c, A, list(range(8)))
    grants = c.pages.grant(B, 3)
    keys = c.keys(scope, list(range(12)))
    assert c.insert(keys, c.page_owners(scope, 3), B, grants) == 0  # B computed the same first page: none cached
    assert [c.pages.owner_of(g.page) for g in grants] == [B, B, B]
    check(c)


def test_eviction_frees_unreferenced_pages_least_recently_used_first_and_a_chain_from_its_end():
    c = cache()
    s1, g1 = computed(c, A, [1] * 8)
    s2, g2 = computed(c, B, [2] * 8)
    c.pages.free(A, g1)
    c.pages.free(B, g2)
    assert c.evictable() == 4 and c.pages.num_free == 4
    c.lend(c.match(c.keys(s1, [1] * 8)), 0xC)  # chain 1 is now the most recent, and held
    assert c.evictable() == 2 and c.evictable(keeping=g2[:1]) == 1
    assert c.evict(1) == 1
    assert c.match(c.keys(s2, [2] * 8)) == g2[:1]  # chain 2's last page went first
    assert c.evict(5) == 1  # held pages stay, however many are asked for
    assert c.match(c.keys(s1, [1] * 8)) == g1[:2] and c.evictions == 2
    assert list(c.pages._free)[-2:] == [g2[1].page, g2[0].page]
    check(c)


def test_a_held_page_is_never_evicted_and_goes_when_its_last_reader_leaves_and_the_cache_evicts():
    c = cache(pages=2)
    scope, grants = computed(c, A, [7] * 8)
    assert c.evict(2) == 0 and c.pages.num_free == 0
    c.pages.free(A, grants)
    assert c.evict(2) == 2 and c.pages.num_free == 2 and not c.entries and not c.held
    check(c)


def test_an_evicted_page_granted_again_has_a_new_epoch_so_the_old_grant_no_longer_verifies():
    c = cache(pages=1)
    scope, grants = computed(c, A, [3] * 4)
    c.pages.free(A, grants)
    old = grants[0]
    owner = c.owner(scope)
    assert c.evict(1) == 1
    new = c.pages.grant(B, 1)[0]
    assert new.page == old.page and new.epoch == old.epoch + 1
    assert not c.pages.holds(owner, old)
    ok = c.pages.verify(np.array([old.page]), np.array([owner >> 64], np.uint64),
                        np.array([owner & (2**64 - 1)], np.uint64), np.array([old.epoch], np.uint64))
    assert not ok.any()


def test_hand_over_refuses_shared_or_written_pages():
    t = PageTable(4)
    a = t.grant(A, 2)
    t.share(A, a[:1], B)
    with pytest.raises(PageError):
        t.hand_over(A, a[:1], 0xC)
    t.set_state(A, a[1:], PageState.WRITING)
    with pytest.raises(PageError):
        t.hand_over(A, a[1:], 0xC)
    with pytest.raises(PageError):
        t.hand_over(B, a[1:], 0xC)  # not B's


def test_the_integrity_check_catches_a_cached_page_the_cache_does_not_hold_and_a_cache_page_it_forgot():
    c = cache()
    scope, grants = computed(c, A, [5] * 8)
    owner = c.owner(scope)
    with pytest.raises(PageError, match="not held by its cache"):
        c.pages.check_integrity({**c.held, 2: owner}, c.owners)  # page 2 is A's own
    with pytest.raises(PageError, match="does not hold"):
        c.pages.check_integrity({0: owner}, c.owners)  # page 1 is the cache's, but not listed
    c.pages.free(A, grants)
    c.evict(2)
    check(c)


def test_public_pages_are_keyed_alike_for_every_tenant_and_the_pages_after_them_are_not():
    c = cache()
    tokens = list(range(12))  # pages 0 and 1 public, page 2 the tenant's own
    alice, bob = (c.keys(c.scope(t, None), tokens, public_pages=2) for t in ("alice", "bob"))
    assert alice[:2] == bob[:2] and alice[2] != bob[2]
    assert alice[0] != c.keys(c.scope("alice", None), tokens)[0]  # a public key is in no tenant's scope
    assert c.page_owners(c.scope("alice", None), 3, public_pages=2) == [c.public_owner] * 2 + [c.owner(c.scope(
        "alice", None))]
    assert c.page_owners(c.scope("alice", None), 1, public_pages=2) == [c.public_owner]


def test_a_public_page_one_tenant_computed_is_lent_to_another_under_the_public_owner_and_only_it():
    c = cache()
    tokens = list(range(12))
    alice = c.scope("alice", None)
    grants = c.pages.grant(A, 3)
    keys = c.keys(alice, tokens, public_pages=2)
    assert c.insert(keys, c.page_owners(alice, 3, public_pages=2), A, grants) == 3
    assert [c.pages.owner_of(g.page) for g in grants] == [c.public_owner] * 2 + [c.owner(alice)]
    hit = c.match(c.keys(c.scope("bob", None), tokens, public_pages=2))
    assert hit == grants[:2]  # bob reads the public pages, not alice's own page 2
    assert c.lend(hit, B) == [c.public_owner] * 2
    assert c.match(c.keys(c.scope("bob", None), tokens)) == []  # without the router's say, nothing is public
    check(c)
