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
    tokens = logits.argmax(dim=-1).tolist()  # greedy for all rows, overwritten below where sampling
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, gen)
    return tokens


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row / p.temperature  # [vocab]
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
        row = row.scatter(0, order[drop], float("-inf"))
    probs = row.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())
