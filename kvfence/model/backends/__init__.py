"""Backends: who computes a model's forward over the paged KV pool, chosen once per process from the host's
``kernels.Capabilities`` (``choose_backend``).

  c-amx, c-avx512, c-avx2   ``c.py``: every row in the C kernels of that flavour (bf16 on CPU)
  torch                     ``torch.py``: torch ops, matmuls in calibrated row blocks (no C kernels, float32, CUDA)
  torch+c-<flavour>-gemm    ``torch.py`` with the C matmul kernel, where the C attention does not fit the heads
                            or the config is not Llama's forward (sliding windows, Gemma, mixture of experts:
                            docs/models.md)

Each is batch-invariant on its own terms, and their bits differ: a process uses one throughout.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvfence.config import ModelConfig
from kvfence.model import kernels
from kvfence.model.backends.c import CBackend
from kvfence.model.backends.torch import TorchBackend
from kvfence.model.batch import Batch
from kvfence.model.weights import Matrix, Weights

__all__ = ["Backend", "CBackend", "TorchBackend", "choose_backend"]


class Backend(Protocol):
    """Computes the forward of ``weights`` (which it may regroup at construction, never replace later)."""

    name: str  # for logs and health: "c-amx", "torch", ...

    def __init__(self, config: ModelConfig, weights: Weights, caps: kernels.Capabilities) -> None: ...

    def forward(self, b: Batch, all_logits: bool) -> torch.Tensor:
        """Write step ``b``'s K/V into the pool and return logits ``[T or B, vocab]`` in the model's dtype, rows in
        processing order; each row's bits do not depend on the other rows of the step."""
        ...

    def prepare_decode_rows(self) -> None:
        """Make what decode rows need (idempotent); engines that decode call it at start."""
        ...

    def set_threads(self, n: int) -> None:
        """Compute on ``n`` threads where that keeps the bits without recalibrating."""
        ...

    def decode_weights(self) -> list[Matrix]:
        """Every weight a decode step reads in full (for the memory-bandwidth limit)."""
        ...


def choose_backend(caps: kernels.Capabilities, config: ModelConfig, dtype: torch.dtype,
                   device: torch.device) -> tuple[type[Backend], str]:
    """``(backend, why)``: the C backend where the C kernels run this dtype and device, compute this config exactly
    (Llama's forward; the rope tables and fused weights may differ) and their attention fits the heads; else torch,
    with the first reason it is not C, in words (a mixture-of-experts config: "the C kernels do not compute
    mixture-of-experts MLPs")."""
    if not caps.runs(dtype, device):
        where = "no C kernels on this CPU" if caps.flavour is None and device.type == "cpu" else (
            f"the C kernels do not run {str(dtype).removeprefix('torch.')} on {device.type}")
        return TorchBackend, where
    differs = config.llama_compatible  # first: mixture-of-experts MLPs and the like, whatever the heads
    if differs is not None:
        return TorchBackend, f"the C kernels do not compute {differs}"
    if not kernels.attention_fits(config.num_heads, config.num_kv_heads, config.head_dim):
        return TorchBackend, "the C attention does not fit the heads"
    return CBackend, "the C kernels compute this config exactly"
