"""`kvfence verify`: the exhaustive model check of the transfer protocol, over the real protocol cores.

The default configuration must explore to completion without a violation, and switching off any one
safety layer must produce a short counterexample that names the broken invariant.
"""

import copy
import gc
import random
import re
from collections import Counter

import pytest

from kvfence.cli import main
from kvfence.protocol.decode import DecodeCore
from kvfence.protocol.messages import Output
from kvfence.protocol.prefill import PrefillCore
from kvfence.protocol.router import RouterCore
from kvfence.safety import Safety
from kvfence.verify.explorer import explore
from kvfence.verify.world import FAULTS, CheckConfig, Faults, RequestSpec, World
from tests.background import background


def unsafe(layers: str, **kw) -> CheckConfig:
    return CheckConfig(safety=Safety.from_env(layers), **kw)


@pytest.mark.fast
def test_the_checked_world_runs_the_production_cores():
    w = World(CheckConfig())
    assert (type(w.router), type(w.prefill.core), type(w.decode.core)) == (RouterCore, PrefillCore, DecodeCore)


@pytest.mark.fast
def test_exploring_leaves_no_reference_cycles():
    """``explore`` pauses the cycle collector (``without_cycle_collection``): a cycle through a state would keep
    every state dropped alive until the exploration ends."""
    gc.collect()
    gc.disable()  # until the count below: no collection in between may hide a cycle
    try:
        assert explore(CheckConfig(), max_states=2000, liveness=False).states == 2000
        gc.set_debug(gc.DEBUG_SAVEALL)
        found = gc.collect()
        kinds = Counter(type(o).__name__ for o in gc.garbage).most_common(5)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert found == 0, kinds


def explore_default():
    return explore(CheckConfig())


@pytest.mark.slow
@background(explore_default)
def test_default_config_explores_to_completion_without_violation(background_result):
    res = background_result
    assert res.violation is None, res.report()
    assert res.complete and res.states > 50_000 and res.quiescent > 0
    text = res.report()
    assert f"explored {res.states:,} states" in text and "no violation" in text


# layer off -> (config, invariants it may break); the default config unless the layer needs more
MUTATIONS = {
    "admission": (unsafe("admission"), {"I3"}),  # an over-length request reaches the workers
    # a prefill started with a smaller context rejects with 400; without L2 the client gets decode's 5xx instead
    "propagation": (unsafe("propagation", prefill_max_context=5), {"I3"}),
    # a lost write leaves another tenant's KV in the page; the transfer checksum (L5) sees it too, so it is off as well
    "tags": (unsafe("tags,checksum"), {"I1", "I6"}),
    # a short prompt leaves stale slots; the checksum (L5) covers them too, so it is off as well
    "coverage": (unsafe("coverage,checksum"), {"I1"}),
    "checksum": (unsafe("checksum"), {"I1"}),  # corrupted bytes are decoded
    "deferred_release": (unsafe("deferred_release"), {"I2"}),  # pages reused while a write may land
    # with per-channel FIFO an Abort cannot overtake its Dest, so L7 is needed once messages may reorder
    "deferred_abort": (unsafe("deferred_abort", network="any"), {"I2"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layer", MUTATIONS)
def test_each_layer_switched_off_gives_a_short_readable_counterexample(layer):
    cfg, broken = MUTATIONS[layer]
    res = explore(cfg)
    assert res.violation is not None, f"{layer} off: no violation found\n{res.report()}"
    assert res.violation.invariant in broken, res.report()
    assert len(res.trace) <= 20, res.report()
    text = res.report()
    assert f"VIOLATION of {res.violation.invariant}" in text and res.violation.message in text
    assert "  1. client" in text  # numbered steps, from the first submission


def explore_router_gate():
    return explore(CheckConfig(router_gate=True))


@pytest.mark.slow
@background(explore_router_gate)
def test_the_router_queue_with_production_dispatch_limits_explores_without_violation(background_result):
    """The router holds B in its queue until A ends (A's reservation fills the 3-page pool), through crashes,
    restarts (queued meanwhile, not failed), disconnects while queued and every data-plane fault."""
    res = background_result
    assert res.ok and res.complete and res.quiescent > 0, res.report()


@pytest.mark.fast
def test_a_prefill_with_a_smaller_context_than_the_router_is_safe_with_every_layer_on():
    res = explore(CheckConfig(prefill_max_context=5, faults=Faults(total=0)))
    assert res.ok, res.report()


def explore_propagation_off():
    return explore(unsafe("propagation"))


@pytest.mark.slow
@background(explore_propagation_off)
def test_propagation_off_is_also_caught_in_the_default_config(background_result):
    res = background_result
    assert res.violation is not None and res.violation.invariant == "I3", res.report()


@pytest.mark.fast
def test_incident_emulation_leaks_another_tenants_kv_once_its_defences_are_off():
    # the checksum (L5) catches the placeholder too: the slots it never wrote do not match the pages' tag records
    cfg = unsafe("admission,coverage,tags,checksum", emulate_incident=True, faults=Faults(total=0))
    res = explore(cfg, invariants=frozenset({"I1", "I6"}))
    assert res.violation is not None and res.violation.invariant == "I1", res.report()
    assert "tenant carol" in res.report()  # the placeholder left the other pages holding someone else's KV


@pytest.mark.slow
def test_incident_emulation_with_every_layer_on_is_caught():
    res = explore(CheckConfig(emulate_incident=True, faults=Faults(total=0)))
    assert res.ok, res.report()


@pytest.mark.slow
def test_copy_on_write_and_cached_keys_match_fully_independent_copies():
    """Along random runs, every enabled event: the parent is untouched, and the child equals a deep copy's."""
    rng = random.Random(3)
    kinds: set[str] = set()
    for _ in range(25):
        w = World(CheckConfig(faults=Faults(drop=1, fence=1, total=2)))
        for _ in range(40):
            events = w.events()
            if not events:
                break
            before = w.key()  # as the explorer does: this fills the cache the children start from
            assert before == w.fresh_key()
            for ev in events:
                child, deep = w.clone(), copy.deepcopy(w)
                child.apply(ev)
                deep.apply(ev)
                assert w.fresh_key() == before, f"{ev} changed its parent"
                assert child.key() == child.fresh_key() == deep.fresh_key(), f"{ev}: cached key is stale"
                kinds.add(ev[0])
            w = w.clone()
            w.apply(rng.choice(events))
    assert {"deliver", "land", "finish", "step", "timeout", "crash", "notice", "restart"} <= kinds, kinds


@pytest.mark.fast
def test_every_fault_kind_is_offered_by_the_environment():
    rng = random.Random(7)
    kinds: set[str] = set()
    for _ in range(30):
        w = World(CheckConfig(faults=Faults(drop=1, fence=1)))
        for _ in range(40):
            events = w.events()
            kinds.update(ev[0] for ev in events)
            progress = [ev for ev in events if ev[0] not in FAULTS]
            if not progress:
                break
            w.apply(rng.choice(progress))
    assert FAULTS <= kinds, FAULTS - kinds


ALICE = RequestSpec("A", "alice", 4, 2, 1)
ONLY = dict(dup=0, crash=0, disconnect=0, fail=0, lose=0, short=0, corrupt=0)  # with these: no other fault


def _drops_the_last_output(w: World, ev: tuple) -> bool:
    if ev[0] != "drop":
        return False
    msg = w.net[ev[1]][ev[2]]
    return isinstance(msg, Output) and msg.finish_reason is not None


@pytest.mark.fast
def test_a_lost_last_output_ends_with_the_routers_silence_timeout():
    """Loss between live processes is off by default (ZeroMQ over TCP does not lose them). Should decode's last
    Output be lost anyway, production's router ends the request after its silence timeout with 503 worker_silent,
    and so does the model: time passes, the router's timers fire, and everything ends clean."""
    w = World(CheckConfig(requests=(ALICE,), faults=Faults(**ONLY, drop=1)))
    for _ in range(200):
        events = w.events()
        chosen = [ev for ev in events if _drops_the_last_output(w, ev)] or [ev for ev in events if ev[0] not in FAULTS]
        if not chosen:
            break
        w.apply(chosen[0])
    client = w.clients[ALICE.rid]
    assert (client.status, client.code, len(client.tokens)) == (503, "worker_silent", 1)
    assert w.quiescent() and not w.violations and w.now > w.router.silence_timeout


@pytest.mark.slow
def test_with_one_lost_message_every_run_still_ends():
    """Every message of the default run may be the lost one: timeouts (the router's silence among them) and
    heartbeats (a lost Hello, lost Peers) end every request; the checker finds no hang."""
    res = explore(CheckConfig(faults=Faults(drop=1, dup=0, crash=0, disconnect=0, fail=0, lose=0, short=0, corrupt=0)))
    assert res.ok and res.complete and res.quiescent > 0, res.report()


def explore_fenced_while_running():
    faults = Faults(**{**ONLY, "fence": 1, "lose": 1, "disconnect": 1}, total=2)
    return explore(CheckConfig(requests=(ALICE,), faults=faults))


@pytest.mark.slow
@background(explore_fenced_while_running)
def test_a_worker_declared_dead_while_it_runs_is_fenced_and_every_run_ends_clean(background_result):
    """The router fences a live worker (paused past --worker-timeout); it runs on, its writes may land, what it sends
    carries its old epoch. Every run ends with A answered once (retried where it had no token), no page reused while
    the fenced writer may write (I2), nothing it sent under the old epoch delivered (I7), nothing leaked (I5)."""
    res = background_result
    assert res.ok and res.complete and res.quiescent > 0, res.report()


@pytest.mark.fast
def test_without_quarantine_for_a_fenced_writer_its_late_writes_land_in_reused_pages(monkeypatch):
    """The harm: a decode worker that frees a fenced writer's pages at once (as for a dead one) grants them to the
    retry while the paused prefill's writes may still land."""
    peer_down = DecodeCore.peer_down
    monkeypatch.setattr(DecodeCore, "peer_down", lambda core, worker, now, fenced=False: peer_down(core, worker, now))
    res = explore(CheckConfig(requests=(ALICE,), faults=Faults(**ONLY, fence=1)))
    assert res.violation is not None and res.violation.invariant == "I2", res.report()
    assert "fences it" in res.report() and len(res.trace) <= 20


@pytest.mark.fast
def test_cli_verify_prints_the_state_count_and_exits_0(capsys):
    assert main(["verify", "--max-faults", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"explored [\d,]+ states", out) and "(complete)" in out and "no violation" in out


@pytest.mark.fast
def test_cli_verify_exits_1_on_a_violation_and_2_at_the_state_cap(capsys):
    assert main(["verify", "--unsafe", "deferred_release", "--max-faults", "0"]) == 1
    assert "VIOLATION of I2" in capsys.readouterr().out
    assert main(["verify", "--max-states", "100"]) == 2
