"""One forward step's plan: the chunks it computes (``SeqChunk``) and the index tensors every backend reads
(``Batch``), built once per step and reused by every layer.

Rows are reordered so that decode chunks (one token) come first, grouped by sequence length: a group shares one
attention call (a batch of sequences, no padding); each longer chunk gets a call of its own. Nothing a row computes
depends on its neighbours, so the backends compute in this order, and ``Batch.chunk_order`` and ``token_order``
restore the caller's.

Sliding windows: a sequence keeps every page it was granted, and a windowed layer reads only the keys inside its
window (``Batch.attn_window``: each chunk's call starts at its first query's window, with a mask for the rest; a
decode group's call keeps each sequence's last ``window`` positions). The pages, their tags, coverage and
checksums are those of a full-attention model: a window frees no page yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvfence.config import ModelConfig
from kvfence.kvcache.pool import KVPool


@dataclass
class SeqChunk:
    token_ids: list[int]  # tokens to compute now (a prefill chunk, or 1 token for decode)
    start_pos: int  # position of token_ids[0] in the sequence
    page_ids: list[int]  # all pages of this sequence, covering positions [0, start_pos + len(token_ids))


@dataclass
class Attn:
    """One attention call: batch rows [q0, q1) attend over rows [k0, k1) of the gathered K/V.

    ``group`` > 0: a decode group, ``group`` sequences of one query each and the same length ``(k1 - k0) / group``.
    Otherwise one chunk of ``q1 - q0`` queries of one sequence whose positions [0, start_pos + n) are [k0, k1).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    group: int
    mask: torch.Tensor | None  # [n, S] bool, bottom-right causal; None when causal or a single query
    causal: bool


@dataclass
class Batch:
    """Per-forward index tensors, built once and reused by every layer. Rows are in processing order (decode
    groups first); ``chunk_order`` and ``token_order`` give the logits rows in the caller's order."""

    tokens: torch.Tensor  # [T]
    cos: torch.Tensor  # [T, 1, R]: R = D, or the rotated dims of a partial rotary (glm4_moe)
    sin: torch.Tensor  # [T, 1, R], sign of the first half flipped (rotate_half folded in)
    local_rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [T, 1, D] of layers with their own table
    kv_layers: tuple[torch.Tensor, ...]  # per layer [num_slots, 2, KV, D]: views of the pool, slot by slot
    write_slots: torch.Tensor  # [T] pool slots of the new tokens
    read_slots: torch.Tensor  # [S_total] pool slots of every sequence's positions, sequence after sequence
    attn: list[Attn]
    attn_window: list[Attn] | None  # the same calls for a windowed layer (decode groups unchanged); None: no window
    decode_rows: int  # rows [0, decode_rows) are decode chunks (one token each), and so are the first logits rows
    decode_kv: int  # read_slots[:decode_kv] are the decode chunks' sequences
    decode_starts: torch.Tensor  # [decode_rows + 1] where each decode chunk's sequence starts in read_slots
    last_rows: torch.Tensor  # [B] row of each chunk's last token, in processing order
    chunk_order: torch.Tensor | None  # [B] logits rows (of last_rows) in the caller's order; None: the same
    token_order: torch.Tensor | None  # [T] logits rows (of all rows) in the caller's order; None: the same


def make_batch(chunks: list[SeqChunk], pool: KVPool, kv_layers: tuple[torch.Tensor, ...], config: ModelConfig,
               cos: torch.Tensor, sin: torch.Tensor,
               local_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> Batch:
    """The plan of one step over ``pool`` (``kv_layers``: its per-layer views), with rotary tables ``cos``/``sin``
    ``[max_context, D]`` (and ``local_rope``'s for the layers that have their own). Raises ``ValueError`` for a
    chunk that is empty, outruns its pages or the context, or names a page or token id out of range."""
    if not chunks:
        raise ValueError("forward needs at least one chunk")
    for c in chunks:
        _check(c, pool, config)
    device = cos.device
    groups: dict[int, list[int]] = {}  # decode chunks by sequence length
    longer = []
    for i, c in enumerate(chunks):
        if len(c.token_ids) == 1:
            groups.setdefault(c.start_pos + 1, []).append(i)
        else:
            longer.append(i)
    order = [i for g in groups.values() for i in g] + longer  # processing order
    ps = pool.page_size
    tokens: list[int] = []
    positions: list[np.ndarray] = []
    reads: list[np.ndarray] = []
    writes: list[np.ndarray] = []
    attn: list[Attn] = []
    first_row = [0] * len(chunks)
    q0 = k0 = 0
    starts = [0]
    for members in groups.values():
        end = chunks[members[0]].start_pos + 1
        for i in members:
            c, first_row[i] = chunks[i], len(tokens)
            tokens.append(c.token_ids[0])
            positions.append(np.arange(end - 1, end))
            reads.append(_slots(c.page_ids, end, ps))
            writes.append(reads[-1][-1:])
        n = len(members)
        starts.extend(range(k0 + end, k0 + (n + 1) * end, end))
        attn.append(Attn(q0, q0 + n, k0, k0 + n * end, n, None, False))
        q0, k0 = q0 + n, k0 + n * end
    for i in longer:
        c = chunks[i]
        n, end = len(c.token_ids), c.start_pos + len(c.token_ids)
        first_row[i] = q0
        tokens.extend(c.token_ids)
        positions.append(np.arange(c.start_pos, end))
        reads.append(_slots(c.page_ids, end, ps))
        writes.append(reads[-1][c.start_pos :])
        attn.append(Attn(q0, q0 + n, k0, k0 + end, 0, _causal_mask(n, end, device), c.start_pos == 0))
        q0, k0 = q0 + n, k0 + end
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    if int(ids.max()) >= config.vocab_size or int(ids.min()) < 0:
        raise ValueError("token id out of range")
    pos = torch.from_numpy(np.concatenate(positions)).to(device)
    sizes = [len(c.token_ids) for c in chunks]
    last = torch.tensor([first_row[i] + sizes[i] - 1 for i in order], device=device)
    chunk_order = token_order = None
    if order != list(range(len(chunks))):
        chunk_order = torch.from_numpy(np.argsort(order)).to(device)
        rows = np.concatenate([np.arange(first_row[i], first_row[i] + sizes[i]) for i in range(len(chunks))])
        token_order = torch.from_numpy(rows).to(device)
    windows = {w for i in range(config.num_layers) if (w := config.window(i)) is not None}
    if len(windows) > 1:
        raise ValueError(f"one sliding window per model, not {sorted(windows)}")
    window = windows.pop() if windows else None
    return Batch(
        tokens=ids,
        cos=cos[pos].unsqueeze(1),
        sin=sin[pos].unsqueeze(1),
        local_rope=None if local_rope is None else (local_rope[0][pos].unsqueeze(1), local_rope[1][pos].unsqueeze(1)),
        kv_layers=kv_layers,
        write_slots=torch.from_numpy(np.concatenate(writes)).to(device),
        read_slots=torch.from_numpy(np.concatenate(reads)).to(device),
        attn=attn,
        attn_window=None if window is None else [_windowed(a, window, device) for a in attn],
        decode_rows=len(starts) - 1,
        decode_kv=starts[-1],
        decode_starts=torch.tensor(starts, dtype=torch.long),
        last_rows=last,
        chunk_order=chunk_order,
        token_order=token_order,
    )


def _check(c: SeqChunk, pool: KVPool, config: ModelConfig) -> None:
    """A chunk is non-empty, fits the context, and its pages (in the pool) cover its positions."""
    end = c.start_pos + len(c.token_ids)
    used = -(-end // pool.page_size)
    if not c.token_ids or c.start_pos < 0 or used > len(c.page_ids) or end > config.max_context:
        raise ValueError(f"bad chunk: {len(c.token_ids)} tokens at {c.start_pos} with {len(c.page_ids)} pages")
    if not all(0 <= p < pool.num_pages for p in c.page_ids[:used]):
        raise ValueError(f"page id out of range (pool has {pool.num_pages} pages)")


def _slots(page_ids: list[int], end: int, page_size: int) -> np.ndarray:
    """Pool slots of positions [0, end) of a sequence holding ``page_ids``: page * page_size + offset."""
    pages = np.asarray(page_ids[: -(-end // page_size)], dtype=np.int64)
    return (pages[:, None] * page_size + np.arange(page_size)).ravel()[:end]


def _causal_mask(n: int, end: int, device: torch.device) -> torch.Tensor | None:
    """Bottom-right aligned causal mask ``[n, end]`` for n queries at positions end - n .. end - 1."""
    if n == 1 or n == end:
        return None  # a single query sees everything; a fresh chunk uses is_causal
    return torch.ones(n, end, dtype=torch.bool, device=device).tril(diagonal=end - n)


def _windowed(a: Attn, window: int, device: torch.device) -> Attn:
    """Chunk call ``a`` for a layer whose queries see the last ``window`` positions (their own included): keys from
    the first query's window on, masked where a later query's window has moved past them. A decode group is
    returned as is (the backend keeps each sequence's last ``window`` positions)."""
    if a.group:
        return a
    n, end = a.q1 - a.q0, a.k1 - a.k0
    start = end - n  # the first query's position
    first = max(0, start - window + 1)  # the first key any query of the chunk sees
    if n == 1 or (first == 0 and n == end and n <= window):
        return Attn(a.q0, a.q1, a.k0 + first, a.k1, 0, None, n > 1)
    q = torch.arange(start, end, device=device)[:, None]  # [n, 1] query positions
    k = torch.arange(first, end, device=device)[None, :]  # [1, end - first] key positions
    return Attn(a.q0, a.q1, a.k0 + first, a.k1, 0, (k <= q) & (k > q - window), False)
