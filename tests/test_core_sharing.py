"""A prefill and a decode worker on the same cores (``serve``'s 1 + 1 default): who computes on how many threads.

The decode worker runs on every core while no prefill works for it, and while one does it steps on its share and
pauses after each step (``PREFILL_YIELD`` times the step, at most ``MAX_PAUSE_S``), so that the prefill worker,
which computes on every core, gets them for a burst of prompts. The pause is bounded and ends as soon as the last
prompt on its way has landed: streams already decoding keep advancing. Real workers (``tests/pair.py``).
"""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from kvfence.cli import local_threads
from kvfence.model import kernels
from kvfence.workers.decode import MAX_PAUSE_S
from tests.pair import Pair

PROMPT = [5 + i for i in range(40)]


def serve_args(prefill: int, decode: int, threads: int = 0, device: str = "cpu") -> argparse.Namespace:
    return argparse.Namespace(prefill=prefill, decode=decode, threads=threads, device=device)


@pytest.mark.fast
def test_serve_splits_the_cores_and_lets_a_lone_decode_worker_yield_them(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1})
    assert local_threads(serve_args(1, 1)) == {"prefill": (2, 0), "decode": (1, 2)}
    assert local_threads(serve_args(2, 1)) == {"prefill": (1, 0), "decode": (1, 2)}  # no one prefill has every core
    assert local_threads(serve_args(1, 2)) == {"prefill": (1, 0), "decode": (1, 0)}  # no decode worker knows it all
    assert local_threads(serve_args(1, 1, threads=3)) == {"prefill": (3, 0), "decode": (3, 0)}  # as asked
    assert local_threads(serve_args(1, 1, device="cuda")) == {"prefill": (0, 0), "decode": (0, 0)}
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0})
    assert local_threads(serve_args(1, 1)) == {"prefill": (1, 0), "decode": (1, 0)}  # nothing to share


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    kernels.set_threads(0)
    torch.set_num_threads(before)


@pytest.mark.model
@pytest.mark.parametrize("solo", [2, 0], ids=["sharing-cores", "own-cores"])
def test_decode_pauses_while_a_prompt_is_on_its_way_and_resumes_when_it_lands(model, threads_restored, solo):
    torch.set_num_threads(1)
    pair = Pair(model, max_context=256, prefill_pool=512, decode_pool=512, dtype="bfloat16", decode_solo_threads=solo)
    decode = pair.decode
    counts_threads = decode.backend != "torch"  # torch's own matmuls keep the count they were calibrated on
    streaming = pair.submit(PROMPT, max_tokens=64)
    assert pair.step_until(lambda: len(pair.results[streaming].tokens) >= 2)
    if solo and counts_threads:
        decode.step()
        assert kernels.threads() == 2  # nothing on its way: every core
    assert decode.paused_until() == 0.0

    arriving = pair.submit(PROMPT[::-1], max_tokens=4)  # Admit reaches decode, Prefill reaches prefill
    pair.pump()
    assert decode.core.prefill_pending()
    before = time.monotonic()
    decode.step()
    paused = decode.paused_until()
    if not solo:
        assert paused == 0.0  # a worker with cores of its own never pauses
    else:
        assert kernels.threads() == 1 or not counts_threads  # its share while prefill computes
        assert before < paused <= time.monotonic() + MAX_PAUSE_S
    assert pair.step_until(lambda: not decode.core.prefill_pending())
    assert decode.paused_until() == 0.0  # the prompt landed: no pause left
    pair.run()
    assert len(pair.results[streaming].tokens) == 64 and len(pair.results[arriving].tokens) == 4
