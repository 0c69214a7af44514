"""Weights kept in their GGUF blocks (Q4_1, Q8_0; K-quants Q4_K, Q5_K, Q6_K), expanded to bf16 inside the matmul
kernel.

A block holds 32 consecutive weights of a row: an fp16 scale d, for Q4_1 an fp16 minimum m and 32 4-bit values
(low nibbles: weights 0-15, high: 16-31), for Q8_0 32 int8. A row keeps its blocks' fields gathered: every d,
then every m, then every block's values, so the kernel converts a row's scales 16 at a time. Q4_1 values go in
pairs of blocks a, b: 32 bytes whose low nibbles are a's weights 0-31 and high nibbles b's, so that widening
the bytes to 16 bits and one mask or one shift give either block's 32 indices in order (an odd last block keeps
the GGUF's order).

A K-quant row keeps the GGUF's own super-blocks of 256 weights, one after another (``blocks.h`` unpacks them):
Q4_K: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and minimums, 128 bytes of 4-bit values; Q5_K: the same
with 32 bytes of fifth bits before the values; Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales
(one per 16 weights) and fp16 d. A weight is ``d sc q - dmin m`` (Q6_K: ``d sc (q - 32)``), each product rounded in
float32 as gguf's dequantize rounds it.

``kernels.gemm`` expands each block to exactly the bf16 values that ``dequantize()`` followed by a cast to bf16
gives (and that the ``gguf`` package's own dequantize gives), so a model that keeps its blocks computes the same
bits as one dequantized at load while reading 3.2x (Q4_1), 1.9x (Q8_0), 3.6x (Q4_K), 2.9x (Q5_K) or 2.4x (Q6_K)
fewer weight bytes per step.
The model keeps blocks only where the C kernels run (``Model.from_state_dict``).

``DecodeBlocks`` holds the same blocks regrouped 16 rows at a time for the int8 kernel that one-token chunks
(decode rows) use where AMX is present (``kernels.gemm`` on it; its arithmetic is in ``decode_gemm.c``): Q4_1 and
Q8_0 only (``INT8_FORMATS``); K-quant rows always take the bf16 expansion.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per block of Q4_1 and Q8_0
QK_K = 256  # weights per K-quant super-block
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per block of each format
BLOCK_WEIGHTS = {"Q4_1": BLOCK, "Q8_0": BLOCK, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}
INT8_FORMATS = ("Q4_1", "Q8_0")  # the formats DecodeBlocks (the int8 kernel) takes
GROUP = 16  # weight rows per group of DecodeBlocks
GROUP_BLOCK_BYTES = {"Q4_1": 320, "Q8_0": 576}  # one block of a group's 16 rows (decode_gemm.c's layout)


@dataclass(frozen=True)
class BlockWeight:
    """An ``[N, K]`` weight as ``rows``: uint8 ``[N, K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt]]``, one row per
    weight row."""

    fmt: str
    rows: torch.Tensor

    @classmethod
    def from_gguf(cls, fmt: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockWeight:
        """``raw``: the tensor's bytes as the GGUF stores them (block after block); ``shape``: ``(N, K)``."""
        n, k = shape
        if fmt not in INT8_FORMATS:  # K-quants: the GGUF's rows as they are
            return cls(fmt, torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, -1)))
        blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, BLOCK_BYTES[fmt])
        fields = (blocks[..., :2], blocks[..., 2:4], _pair_nibbles(blocks[..., 4:])) if fmt == "Q4_1" else (
            blocks[..., :2], blocks[..., 2:])
        return cls(fmt, torch.from_numpy(np.concatenate([f.reshape(n, -1) for f in fields], axis=1)))

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.rows.shape[1] // BLOCK_BYTES[self.fmt] * BLOCK_WEIGHTS[self.fmt]

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
        32]`` (uint8 0-15 for Q4_1, int8 for Q8_0). Q4_1 and Q8_0 only."""
        if self.fmt not in INT8_FORMATS:
            raise ValueError(f"fields() takes Q4_1 or Q8_0 blocks, not {self.fmt}")
        n, k = self.shape
        nb = k // BLOCK
        d = self.rows[:, : 2 * nb].contiguous().view(torch.float16).float()
        if self.fmt == "Q4_1":
            m = self.rows[:, 2 * nb : 4 * nb].contiguous().view(torch.float16).float()
            return d, m, _unpair_nibbles(self.rows[:, 4 * nb :], nb)
        return d, None, self.rows[:, 2 * nb :].contiguous().view(torch.int8).reshape(n, nb, BLOCK)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: ``d * q + m`` (Q4_1) or ``d * q`` (Q8_0), each operation rounded in float32; K-quants
        as ``_dequantize_kquant``: bit for bit what ``gguf.quants.dequantize`` gives."""
        if self.fmt not in INT8_FORMATS:
            return _dequantize_kquant(self.fmt, self.rows).reshape(self.shape)
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

    @staticmethod
    def nbytes_of(w: BlockWeight) -> int:
        """Bytes of ``w`` regrouped (``w.fmt`` in ``INT8_FORMATS``)."""
        n, k = w.shape
        return n // GROUP * k // BLOCK * GROUP_BLOCK_BYTES[w.fmt]

    @classmethod
    def from_blocks(cls, w: BlockWeight, out: torch.Tensor | None = None) -> DecodeBlocks:
        """``w`` regrouped, into ``out`` (uint8, ``nbytes_of(w)`` bytes) where given, else into new memory."""
        if w.fmt not in INT8_FORMATS:
            raise ValueError(f"DecodeBlocks take {' or '.join(INT8_FORMATS)} blocks, not {w.fmt}")
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
        dst = torch.empty(data.shape, dtype=torch.uint8) if out is None else out.view(data.shape)
        return cls(w.fmt, dst.copy_(torch.from_numpy(data)), (n, k))

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


def _dequantize_kquant(fmt: str, rows: torch.Tensor) -> torch.Tensor:
    """K-quant rows ``[N, bytes]`` -> float32 ``[N, nsb, 256]``: gguf's dequantize in torch, the same float32
    operations in the same order (the scales ``d * sc`` and ``dmin * m``, then ``d sc q - dmin m``)."""
    sb = rows.reshape(rows.shape[0], -1, BLOCK_BYTES[fmt])  # [N, nsb, bytes]

    def half(i: int) -> torch.Tensor:  # the fp16 at byte i of each super-block, [N, nsb, 1]
        return sb[..., i : i + 2].contiguous().view(torch.float16).float()

    if fmt == "Q6_K":
        ql, qh = sb[..., :128].reshape(*sb.shape[:2], 2, 1, 64), sb[..., 128:192].reshape(*sb.shape[:2], 2, 1, 32)
        low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).reshape(2, 1)) & 0x0F  # [N, nsb, 2, 2, 64]
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)) & 0x03  # [N, nsb, 2, 4, 32]
        q = (low.reshape(*sb.shape[:2], 8, 32) | (high.reshape(*sb.shape[:2], 8, 32) << 4)).to(torch.int8) - 32
        scale = half(208) * sb[..., 192:208].contiguous().view(torch.int8).float()  # [N, nsb, 16]
        return (scale.unsqueeze(-1) * q.reshape(*sb.shape[:2], 16, 16).float()).reshape(*sb.shape[:2], QK_K)
    s = sb[..., 4:16].reshape(*sb.shape[:2], 3, 4)  # gguf's get_scale_min
    dd, mm, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([dd & 0x3F, (md & 0x0F) | ((dd >> 2) & 0x30)], dim=-1).float()  # [N, nsb, 8]
    mn = torch.cat([mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30)], dim=-1).float()
    d, dm = (half(0) * sc).unsqueeze(-1), (half(2) * mn).unsqueeze(-1)
    qs = sb[..., 48:] if fmt == "Q5_K" else sb[..., 16:]
    q = ((qs.reshape(*sb.shape[:2], 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(2, 1)) & 0x0F)
    q = q.reshape(*sb.shape[:2], 8, 32)
    if fmt == "Q5_K":
        bits = torch.arange(8, dtype=torch.uint8).reshape(8, 1)
        q = q | (((sb[..., 16:48].unsqueeze(-2) >> bits) & 0x01) << 4)
    return (d * q.float() - dm).reshape(*sb.shape[:2], QK_K)
