"""The fault injector of soak tests: parsing ``KVFENCE_FAULTS`` and the fate of each message on a link."""

from __future__ import annotations

import pytest

from kvfence.faults import Faults, FaultyLink, flip_one_byte

pytestmark = pytest.mark.fast


def test_env_value_parses_and_bad_ones_name_the_problem():
    assert Faults.from_env("") is None
    f = Faults.from_env("drop=0.1, dup=0.2,delay=0.5,delay_s=2,flip=0.01,seed=7")
    assert f == Faults(drop=0.1, dup=0.2, delay=0.5, delay_s=2.0, flip=0.01, seed=7)
    assert f.describe() == "drop=0.1, dup=0.2, delay=0.5, delay_s=2.0, flip=0.01, seed=7"
    with pytest.raises(ValueError, match="expected NAME=NUMBER"):
        Faults.from_env("lose=0.1")
    with pytest.raises(ValueError, match="probability"):
        Faults.from_env("drop=2")
    assert Faults.from_env("slow_step=0.01").slow_step == 0.01
    with pytest.raises(ValueError, match="slow_step"):
        Faults.from_env("slow_step=-1")


def test_no_faults_sends_everything_once_in_order():
    link = FaultyLink(Faults(seed=1), "me")
    assert [link.outgoing("a", bytes([i]), 0.0) for i in range(3)] == [[("a", b"\0")], [("a", b"\1")], [("a", b"\2")]]


def test_drops_and_duplicates_happen_at_about_their_rates_and_are_counted():
    link = FaultyLink(Faults(drop=0.1, dup=0.2, seed=3), "me")
    sent = [m for i in range(10_000) for m in link.outgoing("a", b"x", 0.0)]
    c = link.counts
    assert 900 < c["dropped"] < 1100 and 1600 < c["duplicated"] < 2000
    assert len(sent) == 10_000 - c["dropped"] + c["duplicated"]


def test_a_delayed_message_holds_back_later_ones_to_the_same_peer_only():
    link = FaultyLink(Faults(delay=1.0, delay_s=1.0, seed=5), "me")
    assert link.outgoing("a", b"1", 0.0) == []  # held
    link.faults = Faults(seed=5)  # no more faults: what follows is held only to keep the link in order
    assert link.outgoing("a", b"2", 0.1) == []
    assert link.outgoing("b", b"3", 0.1) == [("b", b"3")]
    due = link.held[0].due
    assert link.due(due - 0.01) == []
    assert link.due(due) == [("a", b"1"), ("a", b"2")]
    assert link.outgoing("a", b"4", due) == [("a", b"4")]


def test_every_link_stays_in_order_however_long_each_delay():
    link = FaultyLink(Faults(delay=0.5, delay_s=1.0, seed=11), "me")
    sent = [m for i in range(500) for m in link.outgoing("abc"[i % 3], i.to_bytes(2, "big"), i * 0.001)]
    sent += link.due(10.0)
    assert link.counts["delayed"] > 100 and len(sent) == 500
    for peer in "abc":
        order = [int.from_bytes(d, "big") for p, d in sent if p == peer]
        assert order == sorted(order)


def test_seeded_links_repeat_but_two_processes_differ():
    def fates(salt: str) -> list[int]:
        link = FaultyLink(Faults(drop=0.5, seed=9), salt)
        return [len(link.outgoing("a", b"x", 0.0)) for _ in range(64)]

    assert fates("router") == fates("router") != fates("decode")


def test_flip_inverts_exactly_one_byte_inside_the_range():
    buf = memoryview(bytearray(64))
    offset = flip_one_byte(buf, 16, 8, Faults(seed=1).rng("flip"))
    assert 16 <= offset < 24 and buf[offset] == 0xFF and sum(buf) == 0xFF
