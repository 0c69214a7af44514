"""``kvfence probe``: its pure parts with exact inputs, then two runs against real servers with the real SmolLM2.

The end-to-end runs: a clean ``kvfence serve`` passes (exit 0), its timing phase finding no cache shared across
keys; the incident emulation (docs/safety.md) (every layer off, a prefill pool smaller than the context) is
caught: exit 1, a leak naming victim and receiver, and over-length requests answered 200.
"""

import json
import random
import subprocess
import sys

import pytest

from kvfence.tools.probe import (
    EXIT_CLEAN,
    EXIT_FINDINGS,
    EXIT_INCONCLUSIVE,
    ISOLATED,
    LEAK,
    NO_CACHE,
    NOT_MEASURED,
    UNCLEAR,
    Canary,
    Exchange,
    Limits,
    Report,
    Target,
    Tenant,
    TimingRound,
    attack_targets,
    attack_text,
    cached_tokens,
    canary_prompt,
    classify,
    document_chars_for,
    fit_token_model,
    learn_limits,
    matched,
    must_reject,
    new_canary,
    render_table,
    report_json,
    sse_event,
    timing_prefix,
    timing_prefix_tokens,
    timing_prompt,
    timing_verdict,
    victim_document,
    victim_sizes,
)
from tests.server import ROOT, Server

ZEBRA = Canary("key1", "ZEBRA", "4471")
INCIDENT = Limits(4096, {"decode pool": 1088, "prefill pool": 1024})


def reply(text: str, *, tenant: str = "key3", prompt: str = "tell me a story", status: int = 200,
          role: str = "attacker", tokens: int | None = 40, max_tokens: int = 32, alone: bool = False) -> Exchange:
    return Exchange(7, "pairs", tenant, role, "prefill pool + 1", prompt, max_tokens, status=status, text=text,
                    prompt_tokens=tokens, alone=alone)


# -- canaries and prompts ------------------------------------------------------------------------------


@pytest.mark.fast
def test_canaries_are_fresh_and_their_documents_name_the_code():
    rng = random.Random(1)
    words = [new_canary("key1", rng, []).word for _ in range(3)]
    c = new_canary("key2", rng, words)
    assert c.word not in words and 2100 <= int(c.digits) <= 9999 and c.code == f"{c.word}-{c.digits}"
    assert ZEBRA.sentence == "Repeat exactly: the secret code is ZEBRA-4471."
    doc = victim_document(ZEBRA, 300)
    assert len(doc) <= 300 and doc.count("ZEBRA-4471") == 3 and not doc.endswith(" ")
    assert canary_prompt(ZEBRA, 0) == ZEBRA.sentence
    assert canary_prompt(ZEBRA, 300) == ZEBRA.sentence + "\n" + doc


@pytest.mark.fast
def test_attack_text_has_the_words_asked_for():
    assert attack_text(3) == "tell me a"
    assert len(attack_text(1000).split()) == 1000


# -- sizes -------------------------------------------------------------------------------------------------


@pytest.mark.fast
def test_token_model_is_exact_when_one_word_is_one_token():
    model = fit_token_model([(20, 50), (40, 70), (80, 110)])
    assert model.exact and model.tokens(995) == 1025 and model.words_for(1025) == 995


@pytest.mark.fast
def test_token_model_off_the_line_is_an_estimate():
    model = fit_token_model([(20, 50), (40, 75), (80, 110)])
    assert not model.exact and model.per_word == 1.0
    assert not fit_token_model([(20, 60), (80, 180)]).exact  # two tokens per word


@pytest.mark.fast
def test_the_attacker_grows_to_one_token_past_a_larger_victim():
    target = Target("prefill pool + 1", 1025)
    victim = reply("The secret code is ZEBRA-4471.", role="victim", tokens=1012)
    victim.completion_tokens = 18
    assert matched(target, victim) == Target("prefill pool + 1, victim's 1030 + 1", 1031)
    victim.completion_tokens = 2
    assert matched(target, victim) == target and matched(target, None) == target


@pytest.mark.fast
def test_victims_fill_the_tightest_limit_then_90_percent_of_it():
    assert victim_sizes(INCIDENT, 32, None) == [1012, 972, 921]
    assert victim_sizes(Limits(4096, {"decode pool": 16384}), 32, None) == [4052, 3860, 3657]
    assert victim_sizes(Limits(4096), 32, 600) == [600, 600, 600]


@pytest.mark.fast
def test_document_chars_scale_from_the_sample():
    assert document_chars_for(1046, 1000, 246, 46.0) == 5000  # 5 chars per document token


@pytest.mark.fast
def test_limits_prefer_the_flag_then_models_then_health_and_name_each_distinct_pool():
    models = {"data": [{"id": "m", "max_model_len": 4096}]}
    pools = [("prefill", 1024), ("decode", 1088), ("decode", 1088), ("decode", 2048)]
    limits, notes = learn_limits(None, models, {"max_context": 8192}, pools)
    assert limits == Limits(4096, {"decode pool": 1088, "decode pool 2": 2048, "prefill pool": 1024}) and not notes
    assert learn_limits(2000, models, None, [])[0].context == 2000
    assert learn_limits(None, {"data": [{"id": "m"}]}, {"max_context": 8192}, [])[0].context == 8192
    limits, notes = learn_limits(None, None, None, [])
    assert limits == Limits(None, {}) and "only a far-over prompt" in notes[-1]


@pytest.mark.fast
def test_must_reject_prefill_holds_the_prompt_other_limits_prompt_plus_max_tokens():
    assert must_reject(1024, 32, INCIDENT) is None
    assert must_reject(1025, 32, INCIDENT) == "prompt 1025 > prefill pool 1024"
    assert must_reject(4065, 32, Limits(4096)) == "prompt 4065 + max_tokens 32 > context 4096"
    assert must_reject(1057, 32, Limits(None, {"decode pool": 1088})) == (
        "prompt 1057 + max_tokens 32 > decode pool 1088")
    assert must_reject(10**6, 32, Limits(None)) is None


@pytest.mark.fast
def test_attack_targets_over_first_smallest_first_then_doubled_then_fitting():
    targets = [(t.label, t.tokens) for t in attack_targets(INCIDENT, 32)]
    assert targets[:3] == [("prefill pool + 1", 1025), ("decode pool - max_tokens", 1056),
                           ("decode pool - max_tokens + 1", 1057)]
    assert ("context - max_tokens + 1", 4065) in targets and ("2 x context", 8192) in targets
    assert targets[-2:] == [("prefill pool", 1024), ("prefill pool - 1", 1023)]
    assert len({tokens for _, tokens in targets}) == len(targets)
    assert [t.label for t in attack_targets(Limits(None), 32)] == ["far over (no limit known)"]


# -- findings ------------------------------------------------------------------------------------------------


@pytest.mark.fast
def test_a_leaked_code_names_victim_and_receiver():
    [finding] = classify([reply("- The secret code is ZEBRA-4471")], [ZEBRA], Limits(4096))
    assert (finding.kind, finding.receiver, finding.victims) == ("leak", "key3", ("key1",))
    assert "'ZEBRA-4471'" in finding.detail and "'secret code'" in finding.detail


@pytest.mark.fast
def test_fragments_alone_are_leaks_too():
    [word] = classify([reply("the zebra walked")], [ZEBRA], Limits(4096))
    [digits] = classify([reply("code 4471 it is")], [ZEBRA], Limits(4096))
    [document] = classify([reply("covers the northern region")], [ZEBRA], Limits(4096))
    assert word.victims == digits.victims == document.victims == ("key1",)
    assert "'ZEBRA'" in word.detail and "'4471'" in digits.detail and "'northern region'" in document.detail


@pytest.mark.fast
def test_the_receivers_own_words_and_its_own_canaries_are_not_leaks():
    own = reply("the secret code is 4471 and the zebra", prompt="A zebra said the secret code is 4471.")
    mine = reply("The secret code is ZEBRA-4471.", tenant="key1", role="victim", prompt=ZEBRA.sentence)
    assert classify([own, mine], [ZEBRA], Limits(4096)) == []


@pytest.mark.fast
def test_numbers_and_lower_case_words_must_stand_alone_punctuation_does_not_hide_them():
    assert classify([reply("44712 zebras")], [ZEBRA], Limits(4096)) == []
    [glued] = classify([reply("-The-The ZEBRAHEAVEN-The")], [ZEBRA], Limits(4096))  # seen from SmolLM2
    assert "'ZEBRA'" in glued.detail
    [dashed] = classify([reply("-The-secret-code-The-secret")], [ZEBRA], Limits(4096))
    assert "'secret code'" in dashed.detail


@pytest.mark.fast
def test_a_code_names_only_its_owner_shared_fragments_every_other_canary_tenant():
    carol = Canary("key2", "MANGO", "8123")
    [one] = classify([reply("MANGO-8123")], [ZEBRA, carol], Limits(4096))
    [shared] = classify([reply("a secret code")], [ZEBRA, carol], Limits(4096))
    assert one.victims == ("key2",) and shared.victims == ("key1", "key2")


@pytest.mark.fast
def test_shared_fragments_name_only_tenants_whose_canary_was_sent_before_the_reply_ended():
    carol = Canary("key2", "MANGO", "8123")
    alice_sent = Exchange(1, "pairs", "key1", "victim", "canary", ZEBRA.sentence, 32, canary=ZEBRA.code,
                          status=200, text="The secret code is ZEBRA-4471.", started=0.0, ended=5.0)
    carol_later = Exchange(3, "mix", "key2", "victim", "canary", carol.sentence, 32, canary=carol.code,
                           status=200, text="The secret code is MANGO-8123.", started=20.0, ended=25.0)
    bob = reply("-The-secret-code-The-secret")
    bob.started, bob.ended = 6.0, 12.0
    [leak] = classify([alice_sent, bob, carol_later], [ZEBRA, carol], Limits(4096))
    assert (leak.receiver, leak.victims, leak.request) == ("key3", ("key1",), 7)


@pytest.mark.fast
def test_an_over_length_200_is_a_wrong_status_a_5xx_a_wrong_status_class_a_400_nothing():
    over = dict(tokens=1025)
    found = classify([reply("story", **over), reply("boom", status=503, **over), reply("no", status=400, **over),
                      reply("fits", tokens=1000)], [], INCIDENT)
    assert [(f.kind, f.status) for f in found] == [("wrong status", 200), ("wrong status class", 503)]
    assert found[0].detail == "prompt 1025 > prefill pool 1024, yet HTTP 200 (want 400)"


@pytest.mark.fast
def test_greedy_outputs_under_load_must_equal_those_alone():
    prompt = "What is the capital of France?"
    alone = reply("Paris.", prompt=prompt, role="normal", alone=True)
    same, other = reply("Paris.", prompt=prompt, role="normal"), reply("Lyon.", prompt=prompt, role="normal")
    [finding] = classify([alone, same, other], [], Limits(4096))
    assert finding.kind == "incoherent" and "'Paris.'" in finding.detail and "'Lyon.'" in finding.detail


def report_of(findings, inconclusive=None) -> Report:
    tenants = [Tenant("key1", "sk-alice"), Tenant("key2", "sk-bob")]
    return Report("http://x", "m", INCIDENT, [], tenants, ["key2"], [], [ZEBRA], findings, inconclusive)


@pytest.mark.fast
def test_report_table_and_exit_codes():
    [leak] = classify([reply("ZEBRA-4471", tenant="key2")], [ZEBRA], INCIDENT)
    table = render_table(report_of([leak]))
    assert table.splitlines()[0].split() == ["kind", "receiver", "victims", "request", "status", "detail"]
    assert "leak" in table and "key1=sk-a…ce (canary)" in table and "FINDINGS: 1 leak" in table
    assert report_of([leak]).exit_code == EXIT_FINDINGS
    assert report_of([]).exit_code == EXIT_CLEAN and "OK:" in render_table(report_of([]))
    assert report_of([], "no pair").exit_code == EXIT_INCONCLUSIVE
    assert "CANNOT CONCLUDE: no pair" in render_table(report_of([], "no pair"))


# -- timing: a prefix cache shared across keys ---------------------------------------------------------------


@pytest.mark.fast
def test_timing_prefix_is_1500_tokens_where_the_limits_leave_room_for_it_and_the_question():
    assert timing_prefix_tokens(Limits(4096)) == 1500
    assert timing_prefix_tokens(Limits(None)) == 1500
    assert timing_prefix_tokens(INCIDENT) == 1024 - 48  # the prefill pool holds the prompt alone
    assert timing_prefix_tokens(Limits(1000)) == 1000 - 4 - 48  # the context holds prompt + 4 output tokens


@pytest.mark.fast
def test_timing_prefixes_differ_from_their_first_word_after_the_tag_and_all_through():
    rng = random.Random(3)
    a, b = timing_prefix("12345678", 200, rng), timing_prefix("87654321", 200, rng)
    assert a.startswith("Archive 12345678. ") and len(a.split()) == 202
    assert a.split()[2:] != b.split()[2:]  # the bodies differ too, not only the tags
    assert timing_prompt(a, "Why?") == a + "\n\nWhy?"


def rounds(first, cross, cold, same, cached=None) -> list[TimingRound]:
    """Rounds from per-kind lists (one value per round)."""
    return [TimingRound(*times, cached) for times in zip(first, cross, cold, same, strict=True)]


@pytest.mark.fast
def test_a_cache_shared_across_keys_is_a_leak():
    t = timing_verdict(rounds([1.7, 1.6, 1.66], [0.40, 0.42, 0.39], [1.6, 1.7, 1.68], [0.4, 0.38, 0.41]))
    assert t.verdict == LEAK and t.rounds == 3 and t.fast_rounds == 3
    assert (t.cold, t.same_key, t.cross_key) == (1.67, 0.4, 0.4)  # cold: the victims' first and the fresh ones
    assert "cross-key 0.400 s, same-key 0.400 s, cold 1.670 s (medians of 3 rounds; cross-key fast in 3 of 3" in t.why


@pytest.mark.fast
def test_a_cache_per_key_is_isolated_and_no_cache_is_no_cache():
    cold = [1.6, 1.7, 1.68]
    assert timing_verdict(rounds(cold, [1.65, 1.62, 1.7], cold, [0.4, 0.38, 0.41])).verdict == ISOLATED
    assert timing_verdict(rounds(cold, [1.65, 1.62, 1.7], cold, [1.66, 1.58, 1.71])).verdict == NO_CACHE
    # partly faster is not "markedly": 0.7 x cold
    assert timing_verdict(rounds([1.0] * 3, [0.7] * 3, [1.0] * 3, [0.3] * 3)).verdict == ISOLATED


@pytest.mark.fast
def test_one_noisy_round_does_not_decide_medians_do():
    cold = [1.6, 0.3, 1.7]  # one cold request ran on a quiet moment...
    cross = [1.65, 1.62, 0.2]  # ...and one cross-key request too
    assert timing_verdict(rounds([1.6, 1.6, 1.6], cross, cold, [0.4, 0.38, 0.41])).verdict == ISOLATED


@pytest.mark.fast
def test_medians_that_the_rounds_do_not_bear_out_are_unclear_not_a_leak():
    # seen on a loaded host without a cache: two rounds, their cold times 3 s and 8-12 s apart
    t = timing_verdict(rounds([3.150, 8.189], [3.234, 4.569], [3.527, 12.396], [5.441, 2.834]))
    assert t.verdict != LEAK
    # medians fast (cross 0.9 against cold 3.0), but only one round of three has cross under 0.6 x its own cold
    t = timing_verdict(rounds([1.0, 3.0, 3.0], [0.9, 1.9, 0.5], [1.0, 3.0, 3.0], [0.5, 0.5, 0.5]))
    assert t.verdict == UNCLEAR and t.fast_rounds == 1 and "most rounds do not" in t.why


@pytest.mark.fast
def test_fast_cross_key_with_a_slow_owner_repeat_is_unclear_not_a_leak():
    cold = [1.6, 1.7, 1.68]
    t = timing_verdict(rounds(cold, [0.4, 0.42, 0.39], cold, [1.6, 1.62, 1.7]))
    assert t.verdict == UNCLEAR and "more rounds" in t.why


@pytest.mark.fast
def test_differences_under_the_gap_are_noise_even_when_the_ratio_holds():
    cold = [0.010, 0.012, 0.011]
    assert timing_verdict(rounds(cold, [0.002] * 3, cold, [0.002] * 3)).verdict == NO_CACHE


@pytest.mark.fast
def test_the_servers_own_cached_tokens_across_keys_are_a_leak_whatever_the_times():
    t = timing_verdict(rounds([1.0] * 2, [0.95] * 2, [1.0] * 2, [0.9] * 2, 1408), 1530)
    assert t.verdict == LEAK and "the server reports 1408 of its 1530 prompt tokens cached" in t.why
    assert timing_verdict(rounds([1.0] * 2, [0.95] * 2, [1.0] * 2, [0.9] * 2, 16), 1530).verdict == NO_CACHE


@pytest.mark.fast
def test_too_few_answers_are_not_measured():
    assert timing_verdict(rounds([1.0], [0.3], [1.0], [0.3])).verdict == NOT_MEASURED
    assert timing_verdict(rounds([1.0, 1.0], [0.3, None], [1.0, 1.0], [0.3, 0.3])).verdict == NOT_MEASURED
    assert timing_verdict([]).cold is None


@pytest.mark.fast
def test_sse_events_give_content_and_usage():
    assert sse_event('data: {"choices":[{"delta":{"role":"assistant","content":""}}]}') == ("", None)
    assert sse_event('data: {"choices":[{"delta":{"content":"Hi"}}]}') == ("Hi", None)
    usage = {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 8}}
    assert sse_event("data: " + json.dumps({"choices": [], "usage": usage})) == ("", usage)
    assert sse_event("data: [DONE]") == ("", None) and sse_event(": keep-alive") == ("", None)
    assert cached_tokens(usage) == 8 and cached_tokens({"prompt_tokens_details": None}) is None
    assert cached_tokens(None) is None


@pytest.mark.fast
def test_the_report_shows_the_timing_table_and_a_timing_finding():
    from kvfence.tools.probe import Finding

    t = timing_verdict(rounds([1.7, 1.6, 1.66], [0.40, 0.42, 0.39], [1.6, 1.7, 1.68], [0.4, 0.38, 0.41]), 1530)
    finding = Finding("timing", "key2", ("key1",), 9, "round 1: victim's prefix (cross key)", 200, t.why)
    report = report_of([finding])
    report.timing = t
    table = render_table(report)
    assert "probe: timing (1530-token prompts, 3 rounds): TTFT median, s" in table
    assert "cold (fresh prefixes)       1.670" in table and "cross key (owner's prefix)  0.400" in table
    assert f"probe: timing verdict: {LEAK}:" in table and "FINDINGS: 1 timing" in table
    assert report.exit_code == EXIT_FINDINGS
    assert json.loads(report_json(report))["timing"]["verdict"] == LEAK
    clean = report_of([])
    clean.timing = timing_verdict(rounds([1.6, 1.7], [1.6, 1.7], [1.6, 1.7], [1.6, 1.7]))
    assert "OK: no leak, no wrong status, no incoherence, no cache shared across keys found" in render_table(clean)
    assert json.loads(report_json(report_of([])))["timing"] is None


def fake_cache_server(scope: str | None, cold: float = 0.15, hit: float = 0.01):
    """An OpenAI-compatible mock whose TTFT is ``hit`` for a prompt whose first 40 characters it saw before
    (``scope``: "global" shares what it saw across keys, "key" per key; ``None``: no cache), else ``cold``."""
    import asyncio

    import httpx

    seen: set[tuple[str, str]] = set()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "max_model_len": 4096}]})
        body = json.loads(request.content)
        prompt = body["messages"][0]["content"]
        key = "" if scope == "global" else request.headers["authorization"]
        hit_now = scope is not None and (key, prompt[:40]) in seen
        seen.add((key, prompt[:40]))
        await asyncio.sleep(hit if hit_now else cold)
        tokens = len(prompt.split()) + 30
        usage = {"prompt_tokens": tokens, "completion_tokens": 1,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"delta": {"content": "Sea"}}]}, {"choices": [], "usage": usage}]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    return handler


@pytest.mark.slow
@pytest.mark.parametrize(("scope", "verdict"), [("global", LEAK), ("key", ISOLATED), (None, NO_CACHE)])
def test_the_timing_phase_tells_a_shared_cache_from_one_per_key_and_from_none(scope, verdict):
    import asyncio

    import httpx

    from kvfence.tools.probe import Prober, Settings

    async def run():
        settings = Settings("http://probe.test", [Tenant("key1", "a"), Tenant("key2", "b")], "m", None, 30, 60.0,
                            2, 10.0, 8, None, 1, None, 3)
        transport = httpx.MockTransport(fake_cache_server(scope))
        async with httpx.AsyncClient(base_url=settings.url, transport=transport) as client:
            return await Prober(settings, client, open("/dev/null", "w")).timing(Limits(4096), 3)

    timing, finding = asyncio.run(run())
    assert timing.verdict == verdict, timing
    assert timing.rounds == 3 and timing.cross_cached == 0
    if verdict == LEAK:
        assert (finding.kind, finding.receiver, finding.victims) == ("timing", "key2", ("key1",))
        assert "cross key" in finding.label
    else:
        assert finding is None


# -- against real servers (slow) ---------------------------------------------------------------------------------


def run_probe(server: Server, tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "kvfence.cli", "probe", "--url", server.url, "--key", "sk-alice", "--key",
           "sk-carol", "--key", "sk-bob", "--admin-key", "sk-admin", "--json", str(out), *flags]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return done, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.slow
@pytest.mark.timeout(600)  # a server start and a bounded probe on 2 shared cores
def test_a_clean_kvfence_server_passes(tenants_file, tmp_path):
    with Server("--max-context", "4096", "--tenants", str(tenants_file), ready_timeout=300) as server:
        done, report = run_probe(server, tmp_path, "--requests", "24", "--time-limit", "120",
                                 "--victim-tokens", "600")
    assert done.returncode == EXIT_CLEAN, done.stdout + done.stderr[-3000:]
    assert "OK: no leak" in done.stdout and "probe: " in done.stderr  # the table, and progress lines
    over_length = [r["status"] for r in report["requests"]
                   if r["role"] == "attacker" and r["planned_tokens"] + r["max_tokens"] > 4096]
    assert over_length and set(over_length) == {400}
    # the cache is scoped to the tenant (issue #22): a key's own repeat is fast, another key's prefix is as slow as
    # a fresh one (exit 0 says no timing finding; a loaded host may leave the verdict unclear, never a leak)
    timing = report["timing"]
    assert timing["rounds"] == 3 and timing["verdict"] in (ISOLATED, UNCLEAR)
    assert timing["cross_cached"] <= 32  # at most the chat template's opening, which the last key sent itself


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_with_prefix_scope_off_the_timing_check_catches_the_shared_cache(tenants_file, tmp_path):
    """The harm the ``prefix_scope`` layer prevents, seen from outside: with the tenant out of the cache key, the
    last key's first token on the first key's prefix comes as fast as the first key's own repeat."""
    with Server("--max-context", "4096", "--tenants", str(tenants_file), env={"KVFENCE_UNSAFE": "prefix_scope"},
                ready_timeout=300) as server:
        done, report = run_probe(server, tmp_path, "--requests", "6", "--time-limit", "60", "--victim-tokens", "300")
    assert done.returncode == EXIT_FINDINGS, done.stdout + done.stderr[-3000:]
    timing = report["timing"]
    assert timing["verdict"] == LEAK and timing["fast_rounds"] >= 2, timing
    assert timing["cross_key"] < 0.6 * timing["cold"] and timing["cross_cached"] > 1000
    assert [f["kind"] for f in report["findings"]] == ["timing"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_incident_server_leaks_and_answers_over_length_prompts_with_200(tenants_file, tmp_path):
    flags = ("--emulate-incident", "--prefill-pool-tokens", "1024", "--max-context", "4096",
             "--decode-pool-tokens", "1088", "--tenants", str(tenants_file))
    with Server(*flags, env={"KVFENCE_UNSAFE": "all"}, ready_timeout=300) as server:
        for _ in range(2):  # a leak needs the model to repeat a code from stale KV: most runs show it, not every one
            done, report = run_probe(server, tmp_path, "--requests", "24", "--time-limit", "180", "--no-timing")
            assert done.returncode == EXIT_FINDINGS, done.stdout + done.stderr[-3000:]
            kinds = {f["kind"] for f in report["findings"]}
            if "leak" in kinds:
                break
    assert {"leak", "wrong status"} <= kinds, done.stdout
    leak = next(f for f in report["findings"] if f["kind"] == "leak")
    assert leak["receiver"] == "key3" and set(leak["victims"]) <= {"key1", "key2"} and leak["victims"]
    assert "leak" in done.stdout and "key3" in done.stdout


@pytest.mark.fast
def test_a_server_that_answers_every_chat_with_503_is_inconclusive_not_a_usage_error():
    """Calibration that fails on the server's side (503) is no reason to blame the user (exit 2): the run goes on,
    notes it, and ends inconclusive (exit 3): nothing it needed came back."""
    import asyncio

    import httpx

    from kvfence.tools.probe import Prober, Settings

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "max_model_len": 512}]})
        if request.method == "POST":  # over-length (the probe's attackers) gets its 400, everything else 503
            words = sum(len(m["content"].split()) for m in json.loads(request.content)["messages"])
            if words > 400:
                return httpx.Response(400, json={"error": {"message": "too long", "type": "invalid_request_error",
                                                           "param": "messages", "code": "context_length_exceeded"}})
            return httpx.Response(503, json={"error": {"message": "busy", "type": "server_error", "param": None,
                                                       "code": "unavailable"}})
        return httpx.Response(404, json={})

    async def run() -> Report:
        settings = Settings("http://probe.test", [Tenant("key1", "a"), Tenant("key2", "b")], None, None, 30, 60.0,
                            2, 10.0, 8, None, 1)
        async with httpx.AsyncClient(base_url=settings.url, transport=httpx.MockTransport(handler)) as client:
            return await Prober(settings, client, open("/dev/null", "w")).run()

    report = asyncio.run(run())
    assert report.exit_code == EXIT_INCONCLUSIVE and not report.findings
    assert any("calibration requests failed (503" in note for note in report.notes), report.notes
