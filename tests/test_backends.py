"""The model's backends: which one a host gets (``choose_backend``), that each computes what the torch reference
does, and that raw pointers stay inside the C backend and the kernels."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from kvfence.config import ModelConfig
from kvfence.kvcache.pool import KVPool
from kvfence.model import kernels
from kvfence.model.backends import CBackend, TorchBackend, choose_backend
from kvfence.model.batch import SeqChunk
from kvfence.model.llama import Model
from kvfence.model.loader import load_model
from tests.background import background, rerun
from tests.tiny_models import ARCHS, greedy, tiny_model_dir

CAPS = kernels.detect()
CPU, BF16 = torch.device("cpu"), torch.bfloat16
MODEL_DIR = Path(__file__).resolve().parent.parent / "kvfence" / "model"
# the only files of kvfence/model that may hold raw pointers, and what for
POINTERS = {"kernels.py": "the C entry points", "backends/c.py": "the C forward", "blocks.py": "data_ptr accessors",
            "memory.py": "libc's malloc_trim, a huge-page buffer's alignment"}


def config(heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                       rope_theta=1e4, max_context=64, tie_word_embeddings=True)


def caps(flavour: str | None) -> kernels.Capabilities:
    return dataclasses.replace(CAPS, flavour=flavour)


@pytest.mark.fast
def test_the_c_backend_is_chosen_where_the_kernels_run_and_fit_the_heads():
    assert choose_backend(caps("avx2"), config(), BF16, CPU)[0] is CBackend
    assert choose_backend(caps(None), config(), BF16, CPU)[0] is TorchBackend  # no C kernels (KVFENCE_CPU=none)
    assert choose_backend(caps("amx"), config(), torch.float32, CPU)[0] is TorchBackend  # bf16 only
    assert choose_backend(caps("amx"), config(), BF16, torch.device("cuda"))[0] is TorchBackend
    assert choose_backend(caps("amx"), config(head_dim=24), BF16, CPU)[0] is TorchBackend  # attention does not fit


@pytest.mark.model
def test_the_backend_names_this_processs_flavour():
    """What the logs and the health detail show: ``c-<flavour>`` where the C kernels run (``KVFENCE_CPU`` caps the
    flavour; the forced runs below set it), else ``torch``."""
    model = load_model(str(tiny_model_dir("llama")), dtype=BF16).model
    assert model.backend.name == (f"c-{CAPS.flavour}" if CAPS.flavour else "torch")
    forced = os.environ.get("KVFENCE_CPU")
    if forced in ("amx", "avx512", "avx2") and kernels._cpu_has(*kernels._FLAVOURS[forced][1]):
        assert model.backend.name == f"c-{forced}"
    elif forced == "none":
        assert model.backend.name == "torch"
    assert load_model(str(tiny_model_dir("llama")), dtype=torch.float32).model.backend.name == "torch"


def backends_here(arch: str) -> dict[str, Model]:
    """The tiny bf16 model on every backend this process can run, over the same weights: torch (the reference),
    torch with the C matmuls, and the C backend."""
    loaded = load_model(str(tiny_model_dir(arch)), dtype=BF16)
    cfg, weights = loaded.config, loaded.model.weights
    flavours = [None] + ([CAPS.flavour] if CAPS.flavour else [])
    models = {b.name: Model(cfg, weights, b) for b in (TorchBackend(cfg, weights, caps(f)) for f in flavours)}
    if CAPS.flavour:
        models[loaded.model.backend.name] = loaded.model
    return models


@pytest.mark.model
@pytest.mark.parametrize("arch", [*ARCHS, "phi3-plain"])  # Phi-3 without a window: Llama's forward, fused weights
def test_every_backend_gives_the_greedy_tokens_of_the_torch_reference(arch):
    """Teacher-forced on torch's greedy continuation, each backend's logits (every prompt row too) lie within bf16
    rounding of torch's, and it picks torch's token at every step where torch's choice is clear of that rounding.
    The C kernels sum and round in another order, so their bits differ; on these random-weight models bf16 leaves
    many near-ties (gaps of one or two bf16 steps), where a free-running greedy may go the other way."""
    models = backends_here(arch)
    assert list(models)[0] == "torch" and len(models) == (3 if CAPS.flavour else 1)
    seed = [*ARCHS, "phi3-plain"].index(arch)
    ids = torch.randint(3, 49152, (100,), generator=torch.Generator().manual_seed(seed)).tolist()
    want = greedy(models["torch"], ids, 24, chunk=40)
    ref = logits_along(models["torch"], ids, want)  # [100 + 23, vocab]
    tol = 0.025 * ref.abs().max()  # measured on AMX: at most 0.019
    top2 = ref[len(ids) - 1 :].topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 2 * tol  # [24]
    assert clear.any()
    for name, model in models.items():
        got = logits_along(model, ids, want)
        assert (got - ref).abs().max() <= tol, name
        assert torch.equal(got[len(ids) - 1 :].argmax(-1)[clear], torch.tensor(want)[clear]), name


def logits_along(model: Model, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """Every row's logits of ``ids`` prefilled in chunks of 40, then one decode step per token of ``tokens`` but
    the last: ``[len(ids) + len(tokens) - 1, vocab]``, the last ``len(tokens)`` rows the greedy decisions'."""
    pool = KVPool(model.config, 8, 16, BF16)
    pages = list(range(8))
    rows = [model.forward([SeqChunk(ids[s : s + 40], s, pages)], pool, all_logits=True) for s in range(0, len(ids), 40)]
    rows += [model.forward([SeqChunk([t], len(ids) + i, pages)], pool) for i, t in enumerate(tokens[:-1])]
    return torch.cat(rows)


@pytest.mark.fast
def test_raw_pointers_stay_in_the_c_backend_and_the_kernels():
    """``data_ptr`` and ``ctypes`` appear in kvfence/model only where ``POINTERS`` says."""
    found = {str(p.relative_to(MODEL_DIR)) for p in MODEL_DIR.rglob("*.py")
             if re.search(r"\bdata_ptr\b|\bctypes\b", p.read_text())}
    assert found == set(POINTERS)


def rerun_forced(forced: str) -> subprocess.CompletedProcess:
    """The tests above in a fresh process with ``KVFENCE_CPU=forced``, in the background (tests/background.py)."""
    return rerun(__file__, "not forced", {**os.environ, "KVFENCE_CPU": forced})


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("forced", [f for f in ("amx", "avx512", "avx2", "none") if f != CAPS.flavour])
@background(rerun_forced)
def test_every_forced_flavour_gets_its_backend_and_the_reference_tokens(forced, background_result):
    """The tests above in a fresh process per ``KVFENCE_CPU`` value (the flavour is fixed per process)."""
    run = background_result
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
