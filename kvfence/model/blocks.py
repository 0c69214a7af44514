"""Weights kept in their GGUF blocks (Q4_1, Q8_0), expanded to bf16 inside the matmul kernel.

A block holds 32 consecutive weights of a row: an fp16 scale d, for Q4_1 an fp16 minimum m and 32 4-bit values
(low nibbles: weights 0-15, high: 16-31), for Q8_0 32 int8. A row keeps its blocks' fields gathered: every d,
then every m, then every block's values, so the kernel converts a row's scales 16 at a time. Q4_1 values go in
pairs of blocks a, b: 32 bytes whose low nibbles are a's weights 0-31 and high nibbles b's, so that widening
the bytes to 16 bits and one mask or one shift give either block's 32 indices in order (an odd last block keeps
the GGUF's order).

``kernels.gemm`` expands each block to exactly the bf16 values that ``dequantize()`` followed by a cast to bf16
gives (and that the ``gguf`` package's own dequantize gives), so a model that keeps its blocks computes the same
bits as one dequantized at load while reading 3.2x (Q4_1) or 1.9x (Q8_0) fewer weight bytes per step.
The model keeps blocks only where the C kernels run (``Model.from_state_dict``).

``DecodeBlocks`` holds the same blocks regrouped 16 rows at a time for the int8 kernel that one-token chunks
(decode rows) use where AMX is present (``kernels.gemm`` on it; its arithmetic is in ``decode_gemm.c``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per block
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # fp16 d, (Q4_1: fp16 m, 16 bytes of nibbles | Q8_0: 32 int8)
GROUP = 16  # weight rows per group of DecodeBlocks
GROUP_BLOCK_BYTES = {"Q4_1": 320, "Q8_0": 576}  # one block of a group's 16 rows (decode_gemm.c's layout)


@dataclass(frozen=True)
class BlockWeight:
    """An ``[N, K]`` weight as ``rows``: uint8 ``[N, K / 32 * BLOCK_BYTES[fmt]]``, one row per weight row."""

    fmt: str
    rows: torch.Tensor

    @classmethod
    def from_gguf(cls, fmt: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockWeight:
        """``raw``: the tensor's bytes as the GGUF stores them (block after block); ``shape``: ``(N, K)``."""
        n, k = shape
        blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, BLOCK_BYTES[fmt])
        fields = (blocks[..., :2], blocks[..., 2:4], _pair_nibbles(blocks[..., 4:])) if fmt == "Q4_1" else (
            blocks[..., :2], blocks[..., 2:])
        return cls(fmt, torch.from_numpy(np.concatenate([f.reshape(n, -1) for f in fields], axis=1)))

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.rows.shape[1] // BLOCK_BYTES[self.fmt] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def data_ptr(self) -> int:
        return self.rows.data_ptr()

    @staticmethod
    def cat(weights: list[BlockWeight]) -> BlockWeight:
        """Rows of each weight, one after another (fusing q/k/v or gate/up); all of one format."""
        if len({w.fmt for w in weights}) != 1:
            raise ValueError("cannot fuse weights of different block formats")
        return BlockWeight(weights[0].fmt, torch.cat([w.rows for w in weights]))

    def fields(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Each block's scale d and (Q4_1; else None) minimum m as float32 ``[N, nb]``, and its values ``[N, nb,
        32]`` (uint8 0-15 for Q4_1, int8 for Q8_0)."""
        n, k = self.shape
        nb = k // BLOCK
        d = self.rows[:, : 2 * nb].contiguous().view(torch.float16).float()
        if self.fmt == "Q4_1":
            m = self.rows[:, 2 * nb : 4 * nb].contiguous().view(torch.float16).float()
            return d, m, _unpair_nibbles(self.rows[:, 4 * nb :], nb)
        return d, None, self.rows[:, 2 * nb :].contiguous().view(torch.int8).reshape(n, nb, BLOCK)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: ``d * q + m`` (Q4_1) or ``d * q`` (Q8_0), each operation rounded in float32."""
        d, m, q = self.fields()
        w = d.unsqueeze(-1) * q.float()  # [N, nb, 32]
        if m is not None:
            w = w + m.unsqueeze(-1)
        return w.reshape(self.shape)


@dataclass(frozen=True)
class DecodeBlocks:
    """An ``[N, K]`` block weight as ``data``: uint8 ``[N / 16, K / 32 * GROUP_BLOCK_BYTES[fmt]]``, one row per
    group of 16 weight rows; per block of the group, Q4_1: the rows' 16 fp16 d, 16 fp16 m, then 4 x 64 bytes
    (vector p, lane r, byte i: row r's weight 8p + i in the low nibble, 8p + 4 + i in the high one); Q8_0: 16 fp16
    d, 16 int16 row sums of the values, then 8 x 64 bytes (vector j, lane r, byte i: row r's weight 4j + i)."""

    fmt: str
    data: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_blocks(cls, w: BlockWeight) -> DecodeBlocks:
        n, k = w.shape
        if n % GROUP:
            raise ValueError(f"DecodeBlocks need rows in groups of {GROUP}, got {n}")
        nb, g = k // BLOCK, n // GROUP
        rows = w.rows.numpy()

        def by_group(field: np.ndarray) -> np.ndarray:  # [N, nb, c] -> [g, nb, 16 c]: a block's rows together
            c = field.shape[-1]
            return field.reshape(g, GROUP, nb, c).transpose(0, 2, 1, 3).reshape(g, nb, GROUP * c)

        d = by_group(rows[:, : 2 * nb].reshape(n, nb, 2))
        if w.fmt == "Q4_1":
            m = by_group(rows[:, 2 * nb : 4 * nb].reshape(n, nb, 2))
            q = _unpair_nibbles(w.rows[:, 4 * nb :], nb).numpy().reshape(g, GROUP, nb, 4, 2, 4)  # g r b p half i
            packed = (q[..., 0, :] | (q[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4).reshape(g, nb, 256)
            fields = [d, m, packed]
        else:
            q = rows[:, 2 * nb :].view(np.int8).reshape(g, GROUP, nb, 8, 4)  # g r b j i
            sums = q.sum(axis=(3, 4), dtype=np.int16).transpose(0, 2, 1)  # [g, nb, 16]
            quads = q.transpose(0, 2, 3, 1, 4).reshape(g, nb, 512).view(np.uint8)
            fields = [d, np.ascontiguousarray(sums).view(np.uint8), quads]
        data = np.concatenate(fields, axis=-1).reshape(g, -1)
        return cls(w.fmt, torch.empty(data.shape, dtype=torch.uint8).copy_(torch.from_numpy(data)), (n, k))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def data_ptr(self) -> int:
        return self.data.data_ptr()


def _pair_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF Q4_1 values ``[N, nb, 16]`` -> the kernel's order: per pair of blocks a, b, byte j (0-31) holds a's
    weight j in its low nibble and b's weight j in its high nibble."""
    n, nb, _ = qs.shape
    w = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, nb, 32]: each block's 4-bit weights in order
    out = qs.reshape(n, nb * 16).copy()
    pairs = nb // 2 * 2
    out[:, : pairs * 16] = (w[:, 0:pairs:2] | (w[:, 1:pairs:2] << 4)).reshape(n, pairs * 16)
    return out


def _unpair_nibbles(qs: torch.Tensor, nb: int) -> torch.Tensor:
    """The kernel's Q4_1 values ``[N, nb * 16]`` -> each block's 32 4-bit weights ``[N, nb, 32]``."""
    n, pairs = qs.shape[0], nb // 2 * 2
    paired = qs[:, : pairs * 16].reshape(n, pairs // 2, 32)
    w = torch.stack([paired & 0x0F, paired >> 4], dim=2).reshape(n, pairs, 32)
    if pairs < nb:  # an odd last block, in the GGUF's order
        last = qs[:, pairs * 16 :].reshape(n, 1, 16)
        w = torch.cat([w, torch.cat([last & 0x0F, last >> 4], dim=-1)], dim=1)
    return w
