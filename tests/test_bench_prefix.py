"""``bench/prefix.py``'s pure parts: the load's 80/20 mix, the multi-turn miss controls, the summary's ratios."""

import importlib.util
import random

import pytest

from kvfence.tools.probe import ISOLATED, LEAK
from tests.server import ROOT

pytestmark = pytest.mark.fast


spec = importlib.util.spec_from_file_location("bench_prefix", ROOT / "bench" / "prefix.py")
prefix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prefix)


def test_four_in_five_load_requests_share_their_tenants_system_prompts_the_fifth_is_unique():
    shared = {"alice": ["A1", "A2", "A3"], "bob": ["B1", "B2", "B3"]}
    jobs = prefix.load_jobs(40, shared, 20, random.Random(1))
    tenants = [t for t, _ in jobs]
    assert tenants == ["alice", "bob"] * 20
    systems = [(t, m[0]["content"]) for t, m in jobs]
    mine = [(t, s) for t, s in systems if s in shared[t]]
    assert len(mine) == 32 and all(s[0] == t[0].upper() for t, s in mine)  # each tenant's own prompts only
    unique = [s for _, s in systems if len(s) > 2]
    assert len(unique) == 8 == len(set(unique))
    assert {s for _, s in mine} == {*shared["alice"], *shared["bob"]}  # every shared prompt is used
    questions = [m[1]["content"] for _, m in jobs]
    assert len(set(questions)) == 40  # no request repeats another whole


def test_a_turns_miss_control_is_as_long_and_shares_no_prefix():
    rng = random.Random(2)
    messages = [{"role": "user", "content": prefix.turn_text("chat 11", 1, 30, rng)},
                {"role": "assistant", "content": "The sea."},
                {"role": "user", "content": prefix.turn_text("chat 11", 2, 30, rng)}]
    assert messages[0]["content"].startswith("Archive chat 11, turn 1. ")
    control = prefix.retagged(messages, "chat 11", "chat 22")
    assert control[0]["content"].startswith("Archive chat 22, turn 1. ")
    assert len(control[0]["content"]) == len(messages[0]["content"]) and control[1:] == messages[1:]
    assert messages[0]["content"].startswith("Archive chat 11")  # the chat itself is left as it was


def run(label: str, rnd: int, tok_s: float, cross: float, hit: float) -> dict:
    sample = {"prompt_tokens": 1517, "miss_ttft": 1.0, "hit_ttft": hit, "hit_cached_tokens": None,
              "cross_ttft": cross, "cross_cached_tokens": None, "fresh_ttft": 1.0}
    turn = {"chat": 1, "turn": 2, "prompt_tokens": 700, "hit_ttft": hit / 2, "miss_ttft": 0.5,
            "hit_cached_tokens": None}
    load = {"requests": 32, "failures": 0, "wall_s": 10.0, "output_tok_s": tok_s, "ttft_p50": 2.0, "ttft_p99": 4.0,
            "prompt_tokens": 50000, "cached_tokens": None}
    return {"label": label, "round": rnd, "server_args": [], "system": {"samples": [sample] * 3},
            "multi_turn": [turn], "load": load}


def test_the_summary_pairs_on_and_off_by_round_and_judges_the_cross_key_requests():
    runs = [run("cache on", 1, 200.0, 1.0, 0.2), run("cache off", 1, 100.0, 1.0, 1.0),
            run("cache off", 2, 120.0, 1.0, 1.0), run("cache on", 2, 180.0, 1.0, 0.2)]
    s = prefix.summarise(runs)
    assert s["on_over_off"]["output_tok_s"] == (2.0 + 1.5) / 2 and s["on_over_off"]["ttft_p99"] == 1.0
    assert s["cache on"]["cross_key_verdict"] == ISOLATED and s["cache on"]["system_hit_ttft"] == 0.2
    assert s["cache on"]["multi_turn"][2] == {"prompt_tokens": 700, "hit_ttft": 0.1, "miss_ttft": 0.5}
    leaky = prefix.summarise([run("default", 1, 100.0, 0.2, 0.2)])
    assert leaky["default"]["cross_key_verdict"] == LEAK and "on_over_off" not in leaky
