"""Token sampling: greedy, temperature, top-k, top-p, seeded.

Every row is sampled on its own with its request's own generator, so a
request's tokens never depend on its neighbours in the batch, and the same
seed gives the same tokens.
"""

from __future__ import annotations

import torch

from kvfence.core import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request generator; None for greedy requests."""
    if params.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row of float32 ``logits`` [B, vocab]."""
    tokens = greedy(logits)  # for all rows, overwritten below where sampling
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:  # on the CPU, where its generator is, so a seed draws alike on any device
            tokens[i] = _sample_row(logits[i].cpu(), p, gen)
    return tokens


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's first maximal index (a NaN counts as maximal, as in ``torch.argmax``). On CPU through NumPy,
    whose argmax is ~8x faster than torch's (0.13 vs 1.07 ms for 16 x 49,152)."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


NUCLEUS_FIRST_TRY = 256  # most likely tokens sorted first for top_p; all of them only if these fall short


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row / p.temperature  # [vocab]
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = row.softmax(-1)
    if p.top_p < 1.0:
        probs = _nucleus(probs, p.top_p)
    return _draw(probs, gen)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` with every token outside the nucleus zeroed: the smallest set of most likely tokens whose mass
    reaches ``top_p``. Sorts the 256 most likely first (a full sort of 49k costs ~7 ms), all only if they fall
    short."""
    top = torch.topk(probs, min(NUCLEUS_FIRST_TRY, probs.numel()))  # sorted, most likely first
    cum = top.values.cumsum(0)
    if cum[-1] < top_p and len(cum) < probs.numel():
        top = torch.sort(probs, descending=True)
        cum = top.values.cumsum(0)
    keep = cum - top.values < top_p  # the mass before a token has not reached top_p yet
    out = torch.zeros_like(probs)
    out[top.indices[keep]] = top.values[keep]
    return out


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token with probability proportional to ``probs`` (need not sum to 1): the inverse of the cumulative sum at
    a uniform draw from ``gen``. ``torch.multinomial`` does the same in ~2.4 ms over 49k tokens; this ~0.1 ms."""
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=gen) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_max(len(cdf) - 1).item())
