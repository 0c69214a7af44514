"""`kvfence verify --cache`: the model check of the prefix cache's page bookkeeping, over the production code.

The default configuration must explore to completion without a violation while exercising every kind of
bookkeeping it exists for; each mutation (a layer off, or a careless eviction) must be caught by its named
invariant with a short trace.
"""

import dataclasses
import json
import pickle
import random
import re

import pytest

from kvfence.cli import main
from kvfence.engine.scheduler import Scheduler
from kvfence.kvcache.pages import PageTable
from kvfence.kvcache.prefix import PrefixCache
from kvfence.safety import Safety
from kvfence.verify.cache import CacheConfig, CacheRequest, CacheWorld, CarelessCache, explore_cache

pytestmark = pytest.mark.slow

EXERCISED = {"abort", "admission", "cache hit", "cache insert", "early stop", "eviction under pressure",
             "fork: copy", "fork: wait", "preemption"}


def test_the_checked_world_runs_the_production_bookkeeping():
    w = CacheWorld(CacheConfig())
    assert (type(w.pages), type(w.cache), type(w.sched)) == (PageTable, PrefixCache, Scheduler)
    assert w.sched.cache is w.cache and w.cache.pages is w.pages
    assert type(CacheWorld(CacheConfig(careless_evict=True)).cache) is CarelessCache


def test_default_config_explores_to_completion_without_violation_and_exercises_everything():
    res = explore_cache()
    assert res.violation is None, res.report()
    assert res.complete and res.states > 1_000 and res.quiescent > 0
    assert EXERCISED <= set(res.coverage), res.coverage
    text = res.report()
    assert f"explored {res.states:,} states" in text and "no violation" in text


def test_every_arrival_order_and_eviction_at_any_time_are_safe_too():
    cfg = CacheConfig(arrival="any", evict_any_time=True, requests=(
        CacheRequest("A", "alice", (1, 2, 3, 4), 2), CacheRequest("C", "bob", (1, 2, 3), 2, n=2),
        CacheRequest("B", "bob", (1, 2, 3, 4), 1)))
    res = explore_cache(cfg)
    assert res.ok, res.report()
    assert {"eviction (event)", "cache hit", "fork: copy"} <= set(res.coverage)


def test_salts_of_one_tenant_are_kept_apart():
    cfg = CacheConfig(arrival="any", requests=(
        CacheRequest("A", "alice", (1, 2, 3, 4), 1, salt="s1"), CacheRequest("B", "alice", (1, 2, 3, 4), 1, salt="s2"),
        CacheRequest("C", "alice", (1, 2, 3, 4), 1, salt="s1")))
    res = explore_cache(cfg)
    assert res.ok and "cache hit" in res.coverage, res.report()  # C reads A's pages, B never does


def unsafe(layers: str, **kw) -> CacheConfig:
    return CacheConfig(safety=Safety.from_env(layers), **kw)


# mutation -> (config, the invariant it must break)
MUTATIONS = {
    "prefix_scope": (unsafe("prefix_scope"), "C3"),  # bob's prompt hits alice's cached pages
    "shared_write": (unsafe("shared_write"), "C1"),  # a fork shares its partial last page; both choices write it
    "careless_evict": (CacheConfig(careless_evict=True), "C2"),  # eviction frees a page a request still reads
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_mutation_is_caught_by_its_invariant_with_a_short_trace(mutation):
    cfg, broken = MUTATIONS[mutation]
    res = explore_cache(cfg)
    assert res.violation is not None and res.violation.invariant == broken, res.report()
    assert 0 < len(res.trace) <= 10, res.report()
    text = res.report()
    assert f"VIOLATION of {broken}" in text and text.rstrip().endswith(res.violation.message)


def test_the_cross_tenant_read_names_both_tenants():
    res = explore_cache(MUTATIONS["prefix_scope"][0])
    assert "B (bob" in res.violation.message and "K/V of alice" in res.violation.message, res.report()


def test_with_prefix_scope_off_a_salt_no_longer_separates_either():
    cfg = unsafe("prefix_scope", requests=(CacheRequest("A", "alice", (1, 2, 3, 4), 1, salt="s1"),
                                           CacheRequest("B", "alice", (1, 2, 3, 4), 1, salt="s2")))
    res = explore_cache(cfg)
    assert res.violation is not None and res.violation.invariant == "C3", res.report()
    assert "salt s2" in res.violation.message and "salt s1" in res.violation.message


def test_a_published_prefix_is_read_across_tenants_and_nothing_after_it():
    """alice's first page is the published prefix: bob's requests read it (and only it) from her computation."""
    cfg = CacheConfig(published=(1, 2))
    res = explore_cache(cfg)
    assert res.ok and res.coverage["public hit"] > 0, res.report()
    requests = (CacheRequest("A", "alice", (1, 2, 3, 4), 1), CacheRequest("B", "bob", (1, 2, 3, 4, 5, 6), 1))
    assert explore_cache(dataclasses.replace(cfg, requests=requests)).ok
    overmarked = explore_cache(dataclasses.replace(cfg, requests=requests, overmark_public=True))
    assert overmarked.violation is not None and overmarked.violation.invariant == "C3", overmarked.report()
    assert "K/V of alice" in overmarked.violation.message


def test_frozen_states_thaw_to_the_same_state_as_a_full_copy():
    cfg = CacheConfig(arrival="any", evict_any_time=True)
    root = CacheWorld(cfg)
    for seed in range(40):
        rnd = random.Random(seed)
        full, thawed = CacheWorld(cfg), root.thaw(root.frozen())
        while not full.quiescent():
            ev = rnd.choice(full.events())
            full = pickle.loads(pickle.dumps(full))
            thawed = root.thaw(thawed.frozen())
            full.apply(ev)
            thawed.apply(ev)
            assert full.key() == thawed.key() and full.violations == thawed.violations == [], (seed, ev)
            assert full.check_state() == thawed.check_state() == []


def test_cli_verify_cache_prints_the_state_count_and_exits_0(capsys):
    assert main(["verify", "--cache"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("prefix-cache pages:") and re.search(r"explored [\d,]+ states", out)
    assert "(complete)" in out and "no violation" in out


def test_cli_verify_cache_exits_1_on_each_mutation(capsys):
    assert main(["verify", "--cache", "--unsafe", "shared_write"]) == 1
    assert "VIOLATION of C1" in capsys.readouterr().out
    assert main(["verify", "--cache", "--cache-mutant", "careless-evict"]) == 1
    assert "VIOLATION of C2" in capsys.readouterr().out
    assert main(["verify", "--cache", "--unsafe", "prefix_scope",
                 "--cache-requests", "A=alice/s1:1.2.3.4+1,B=alice/s2:1.2.3.4+1"]) == 1
    assert "VIOLATION of C3" in capsys.readouterr().out


def test_cli_verify_json_has_both_checks_state_counts(capsys):
    assert main(["verify", "--max-faults", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["protocol"]["states"] > 1_000 and out["cache"]["states"] > 1_000
    assert out["protocol"]["violation"] is None and out["cache"]["complete"]


def test_a_fork_whose_copy_is_never_made_reads_stale_bytes(monkeypatch):
    attach = Scheduler.attach

    def forgetful(self, seq, branch, shared_write=True):  # grants the copy's page, but the pool never copies
        attach(self, seq, branch, shared_write)

    monkeypatch.setattr(Scheduler, "attach", forgetful)
    res = explore_cache()
    assert res.violation is not None and res.violation.invariant == "C5", res.report()
    assert res.violation.message.startswith("C#1 reads position"), res.report()
