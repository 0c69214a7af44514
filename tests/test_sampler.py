"""Sampling: the right distribution, top-k and top-p sets exactly as defined, seeds that repeat, rows alone."""

import torch

from kvfence.core import SamplingParams
from kvfence.engine.sampler import NUCLEUS_FIRST_TRY, greedy, make_generator, sample


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=1, **kw)


def draws(logits: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    gen = make_generator(p)
    return torch.tensor([sample(logits[None], [p], [gen])[0] for _ in range(n)])


def nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> set[int]:
    values, order = torch.sort(probs, descending=True)
    keep = values.cumsum(0) - values < top_p
    return set(order[keep].tolist())


def test_greedy_takes_each_rows_first_maximum_as_torch_argmax_does():
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(3))
    logits[1, [7, 9000, 40000]] = 50.0  # ties: the first one wins
    logits[2, [11, 30]] = float("nan")  # NaN counts as maximal
    logits[3] = float("-inf")
    got = greedy(logits)
    assert got[1] == 7 and got[2] == 11 and got[3] == 0
    assert got == logits.argmax(dim=-1).tolist()


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    p = params(temperature=0.8, seed=7)
    counts = torch.bincount(draws(logits, p, 6000), minlength=5).float() / 6000
    want = (logits / 0.8).softmax(-1)
    assert (counts - want).abs().max() < 0.02, (counts, want)
    assert counts[4] == 0  # e^-37 relative: never drawn


def test_the_same_seed_repeats_and_another_seed_differs():
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(1)) * 2
    a, b = draws(logits, params(temperature=1.0, seed=3), 50), draws(logits, params(temperature=1.0, seed=3), 50)
    c = draws(logits, params(temperature=1.0, seed=4), 50)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_draws_only_the_k_most_likely_and_top_k_1_is_greedy():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    allowed = set(torch.topk(logits, 5).indices.tolist())
    got = set(draws(logits, params(temperature=2.0, top_k=5, seed=1), 400).tolist())
    assert got == allowed  # 400 draws at temperature 2 reach all five
    assert set(draws(logits, params(temperature=1.5, top_k=1, seed=1), 20).tolist()) == {int(logits.argmax())}


def test_top_p_draws_exactly_from_the_nucleus_small_or_larger_than_the_first_try():
    for spread, top_p in ((4.0, 0.5), (0.3, 0.95)):  # a nucleus of a few tokens, and one of thousands
        logits = torch.randn(49152, generator=torch.Generator().manual_seed(5)) * spread
        nucleus = nucleus_by_full_sort(logits.softmax(-1), top_p)
        got = set(draws(logits, params(temperature=1.0, top_p=top_p, seed=2), 300).tolist())
        assert got <= nucleus, len(got - nucleus)
        if len(nucleus) <= 5:
            assert got == nucleus
    assert len(nucleus) > NUCLEUS_FIRST_TRY  # the second case took the full sort


def test_a_row_is_sampled_the_same_whatever_its_neighbours():
    gen_logits = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 5000, generator=gen_logits)
    ps = [params(temperature=0.9, seed=11), params(temperature=0.0), params(temperature=1.2, top_p=0.8, seed=12),
          params(temperature=0.7, top_k=20, seed=13)]
    together = sample(logits, ps, [make_generator(p) for p in ps])
    alone = [sample(logits[i : i + 1], [p], [make_generator(p)])[0] for i, p in enumerate(ps)]
    assert together == alone and together[1] == int(logits[1].argmax())
