"""Sampling: the right distribution, top-k, top-p and min-p sets exactly as defined, seeds that repeat, rows alone;
penalties, bias and the min_tokens ban as OpenAI and vLLM define them; logprobs from the raw logits."""

import pytest
import torch

from kvfence.core import Request, SamplingParams
from kvfence.engine.sampler import NUCLEUS_FIRST_TRY, greedy, make_generator, sample, token_logprobs

EOS = frozenset({2})


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=1, **kw)


def req(p: SamplingParams, prompt: list[int] = (5,), output: list[int] = ()) -> Request:
    return Request(list(prompt), p, output_ids=list(output))


def draws(logits: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    gen, r = make_generator(p), req(p)
    return torch.tensor([sample(logits[None], [r], [gen], EOS)[0] for _ in range(n)])


def nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> set[int]:
    values, order = torch.sort(probs, descending=True)
    keep = values.cumsum(0) - values < top_p
    return set(order[keep].tolist())


@pytest.mark.fast
def test_greedy_takes_each_rows_first_maximum_as_torch_argmax_does():
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(3))
    logits[1, [7, 9000, 40000]] = 50.0  # ties: the first one wins
    logits[2, [11, 30]] = float("nan")  # NaN counts as maximal
    logits[3] = float("-inf")
    got = greedy(logits)
    assert got[1] == 7 and got[2] == 11 and got[3] == 0
    assert got == logits.argmax(dim=-1).tolist()


@pytest.mark.fast
def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    p = params(temperature=0.8, seed=7)
    counts = torch.bincount(draws(logits, p, 6000), minlength=5).float() / 6000
    want = (logits / 0.8).softmax(-1)
    assert (counts - want).abs().max() < 0.02, (counts, want)
    assert counts[4] == 0  # e^-37 relative: never drawn


@pytest.mark.slow
def test_the_same_seed_repeats_and_another_seed_differs():
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(1)) * 2
    a, b = draws(logits, params(temperature=1.0, seed=3), 50), draws(logits, params(temperature=1.0, seed=3), 50)
    c = draws(logits, params(temperature=1.0, seed=4), 50)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.fast
def test_top_k_draws_only_the_k_most_likely_and_top_k_1_is_greedy():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    allowed = set(torch.topk(logits, 5).indices.tolist())
    got = set(draws(logits, params(temperature=2.0, top_k=5, seed=1), 400).tolist())
    assert got == allowed  # 400 draws at temperature 2 reach all five
    assert set(draws(logits, params(temperature=1.5, top_k=1, seed=1), 20).tolist()) == {int(logits.argmax())}


@pytest.mark.slow
def test_top_p_draws_exactly_from_the_nucleus_small_or_larger_than_the_first_try():
    for spread, top_p in ((4.0, 0.5), (0.3, 0.95)):  # a nucleus of a few tokens, and one of thousands
        logits = torch.randn(49152, generator=torch.Generator().manual_seed(5)) * spread
        nucleus = nucleus_by_full_sort(logits.softmax(-1), top_p)
        got = set(draws(logits, params(temperature=1.0, top_p=top_p, seed=2), 300).tolist())
        assert got <= nucleus, len(got - nucleus)
        if len(nucleus) <= 5:
            assert got == nucleus
    assert len(nucleus) > NUCLEUS_FIRST_TRY  # the second case took the full sort


@pytest.mark.fast
def test_a_row_is_sampled_the_same_whatever_its_neighbours():
    gen_logits = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 5000, generator=gen_logits)
    ps = [params(temperature=0.9, seed=11), params(temperature=0.0), params(temperature=1.2, top_p=0.8, seed=12),
          params(temperature=0.7, top_k=20, seed=13)]
    together = sample(logits, [req(p) for p in ps], [make_generator(p) for p in ps], EOS)
    alone = [sample(logits[i : i + 1], [req(p)], [make_generator(p)], EOS)[0] for i, p in enumerate(ps)]
    assert together == alone and together[1] == int(logits[1].argmax())


def greedy_pick(logits: torch.Tensor, r: Request) -> int:
    return sample(logits[None], [r], [None], EOS)[0]


@pytest.mark.fast
def test_penalties_follow_their_definitions():
    logits = torch.tensor([0.0, 3.0, -2.0, 2.9, 2.0, 1.0])
    plain = params(temperature=0.0)
    assert greedy_pick(logits, req(plain)) == 1
    # frequency: minus 0.08 per occurrence in the output (once: 2.92 > 2.9; twice: 2.84 < 2.9)
    assert greedy_pick(logits, req(params(temperature=0.0, frequency_penalty=0.08), output=[1, 1])) == 3
    assert greedy_pick(logits, req(params(temperature=0.0, frequency_penalty=0.08), output=[1])) == 1
    # presence: once, however often (3.0 - 0.5 < 2.9)
    assert greedy_pick(logits, req(params(temperature=0.0, presence_penalty=0.5), output=[1])) == 3
    # a negative penalty encourages
    assert greedy_pick(logits, req(params(temperature=0.0, presence_penalty=-2.0), output=[4])) == 4
    # repetition: divides positive logits, multiplies negative ones, and counts the prompt too
    rep = params(temperature=0.0, repetition_penalty=2.0)
    assert greedy_pick(logits, req(rep, prompt=[1])) == 3
    shaped = logits.clone()
    from kvfence.engine.sampler import shape
    shape(shaped, req(rep, prompt=[1, 2]), EOS)
    assert shaped[1] == 1.5 and shaped[2] == -4.0 and shaped[3] == 2.9
    # penalties on the prompt alone: presence and frequency look at the output only
    assert greedy_pick(logits, req(params(temperature=0.0, frequency_penalty=2.0), prompt=[1])) == 1


@pytest.mark.fast
def test_logit_bias_and_the_min_tokens_ban():
    logits = torch.tensor([0.0, 3.0, 5.0, 1.0])  # token 2 is EOS here
    assert greedy_pick(logits, req(params(temperature=0.0, logit_bias=((3, 10.0),)))) == 3
    assert greedy_pick(logits, req(params(temperature=0.0, logit_bias=((2, -100.0),)))) == 1
    ban = params(temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    assert greedy_pick(logits, req(ban, output=[0])) == 3  # EOS and the stop token id are banned until 2 tokens
    assert greedy_pick(logits, req(ban, output=[0, 0])) == 2
    eos_ignored = params(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert greedy_pick(logits, req(eos_ignored)) == 2  # EOS does not end such a request: nothing to ban
    # sampled, not only greedy: a banned token is never drawn
    hot = params(temperature=5.0, seed=3, min_tokens=5)
    gen = make_generator(hot)
    assert 2 not in {sample(logits[None], [req(hot)], [gen], EOS)[0] for _ in range(300)}


@pytest.mark.fast
def test_min_p_keeps_exactly_the_tokens_near_the_top():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    got = set(draws(logits, params(temperature=1.0, min_p=0.15, seed=4), 500).tolist())
    assert got == {0, 1, 2}  # 0.1 >= 0.15 * 0.5; 0.06 is not


@pytest.mark.fast
def test_shaping_leaves_the_logits_alone_and_logprobs_come_from_them():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    p = params(temperature=0.0, presence_penalty=2.0, logit_bias=((7, 50.0),), logprobs=3)
    rows = [req(p, output=[int(logits[0].argmax())]), req(params(temperature=0.0))]
    tokens = sample(logits, rows, [None, None], EOS)
    assert tokens[0] == 7 and torch.equal(logits, before)
    got = token_logprobs(logits, rows, tokens)
    raw = torch.log_softmax(logits[0], -1)
    assert got[1] is None
    assert got[0].logprob == pytest.approx(float(raw[7]))  # raw: before the bias that picked it
    top = torch.topk(raw, 3)
    assert [t for t, _ in got[0].top] == top.indices.tolist()
    assert [v for _, v in got[0].top] == pytest.approx(top.values.tolist())


@pytest.mark.fast
def test_a_shaped_row_is_sampled_the_same_whatever_its_neighbours():
    logits = torch.randn(3, 4000, generator=torch.Generator().manual_seed(2))
    ps = [params(temperature=0.8, seed=5, repetition_penalty=1.3, frequency_penalty=0.5),
          params(temperature=0.0, logit_bias=((17, 3.0),)), params(temperature=1.1, seed=6, min_p=0.05)]
    rows = [req(p, prompt=[3, 9, 27], output=[11, 11, 40]) for p in ps]
    together = sample(logits, rows, [make_generator(p) for p in ps], EOS)
    alone = [sample(logits[i : i + 1], [r], [make_generator(r.params)], EOS)[0] for i, r in enumerate(rows)]
    assert together == alone
