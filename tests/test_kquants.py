"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept in their super-blocks: the torch dequantize against gguf's, every C
flavour this CPU runs against the dequantized bf16 weights (bit for bit, any batch), and a tiny random Llama
written as a K-quant GGUF computing what its dequantized copy computes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvfence.kvcache.pool import KVPool
from kvfence.model import kernels
from kvfence.model.batch import SeqChunk
from kvfence.model.blocks import BLOCK_BYTES, BlockWeight
from kvfence.model.gguf_file import read_gguf
from kvfence.model.loader import load_model, smollm2_gguf_path
from tests.tiny_models import greedy

KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
FLAVOURS = ("amx", "avx512", "avx2")
_D_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # the fp16 scales (d, dmin) in a super-block


def random_kquant(fmt: str, n: int, k: int, rng: np.random.Generator, scale: float = 1e-3) -> np.ndarray:
    """An ``[n, k]`` GGUF tensor of ``fmt`` super-blocks (uint8 ``[n, bytes]``): random bits, but fp16 scales of
    either sign and magnitude below ``scale`` (no inf or NaN; some subnormal)."""
    raw = rng.integers(0, 256, (n, k // 256, BLOCK_BYTES[fmt]), dtype=np.uint8)
    for off in _D_OFFSETS[fmt]:
        d = (rng.uniform(-scale, scale, raw.shape[:2]) * rng.choice([1, 1e-4], raw.shape[:2])).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def gguf_dequantize(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, fmt)).reshape(shape))


@pytest.mark.fast
@pytest.mark.parametrize("fmt", KQUANTS)
def test_dequantize_is_gguf_bit_for_bit(fmt):
    rng = np.random.default_rng(len(fmt) + ord(fmt[1]))
    for n, k in ((1, 256), (16, 768), (5, 2048)):
        raw = random_kquant(fmt, n, k, rng)
        w = BlockWeight.from_gguf(fmt, raw, (n, k))
        assert w.shape == (n, k) and w.nbytes == raw.nbytes
        ref = gguf_dequantize(raw, fmt, (n, k))
        assert torch.isfinite(ref).all() and (ref == 0).float().mean() < 0.2
        assert torch.equal(w.dequantize(), ref), (fmt, n, k)


def flavour_library(name: str):
    """Flavour ``name``'s C library, built and loaded beside the process's own (skips where the CPU lacks it)."""
    if not kernels._cpu_has(*kernels._FLAVOURS[name][1]):
        pytest.skip(f"this CPU lacks {name}")
    so = kernels._load(name)
    if so is None:
        pytest.skip(f"{name} does not build here")
    return so


def flavour_gemm(so, amx: bool, x: torch.Tensor, w: torch.Tensor | BlockWeight) -> torch.Tensor:
    """``x @ w.T`` in one flavour's library, as ``kernels.gemm_entry`` picks its entry point."""
    M, K = x.shape
    N = w.shape[0]
    if isinstance(w, BlockWeight):
        fn, arg = (so.kvf_gemm_amx_blocks if amx else so.kvf_gemm_blocks), kernels._FORMAT_IDS[w.fmt]
    else:
        fn, arg = (so.kvf_gemm_amx if amx else so.kvf_gemm_bf16), K
    out = torch.empty(M, N, dtype=torch.bfloat16)
    fn(x.data_ptr(), x.stride(0), w.data_ptr(), arg, out.data_ptr(), N, M, N, K, 2)
    return out


@pytest.mark.model
@pytest.mark.parametrize("fmt", KQUANTS)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_flavour_expands_kquants_exactly_and_rows_alone(flavour, fmt):
    """Each flavour's matmul on the super-blocks gives the bits of its matmul on the dequantized bf16 weights (so
    of a model dequantized at load), close to a float32 reference, for any number of rows (1 to 40: vectors and
    tiles, each x row alone, the same bits in any batch), with rows of 64-row groups and a last group of 16; and
    the embedding's gather gives the dequantized rows."""
    so, amx = flavour_library(flavour), flavour == "amx"
    rng = np.random.default_rng(FLAVOURS.index(flavour) * 3 + KQUANTS.index(fmt))
    n, k = 80, 1024
    raw = random_kquant(fmt, n, k, rng)
    w = BlockWeight.from_gguf(fmt, raw, (n, k))
    dense = gguf_dequantize(raw, fmt, (n, k)).bfloat16()
    x = torch.from_numpy(rng.standard_normal((40, k), dtype=np.float32)).bfloat16()
    whole = flavour_gemm(so, amx, x, w)
    ref = x.float() @ dense.float().T
    assert ((whole.float() - ref).abs().max() <= 0.02 * ref.abs().max()), flavour
    for m in (1, 2, 5, 16, 17, 40):
        assert torch.equal(flavour_gemm(so, amx, x[:m], w), flavour_gemm(so, amx, x[:m], dense)), (flavour, fmt, m)
        assert torch.equal(flavour_gemm(so, amx, x[:m], w), whole[:m]), (flavour, fmt, m)  # batch-invariant
    for i in (0, 7, 39):
        assert torch.equal(flavour_gemm(so, amx, x[i : i + 1], w), whole[i : i + 1]), (flavour, fmt, i)
    rows = torch.tensor([0, 79, 3, 3], dtype=torch.int64)
    out = torch.empty(len(rows), k, dtype=torch.bfloat16)
    so.kvf_expand_rows(w.data_ptr(), kernels._FORMAT_IDS[fmt], rows.data_ptr(), len(rows), k, out.data_ptr())
    assert torch.equal(out, dense[rows])


# -- a tiny random Llama written as a K-quant GGUF ----------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
# per tensor its format: layer 0 mixes formats inside q/k/v (its fused qkv is dequantized), layer 1 does not
FORMATS = {
    "token_embd": "Q4_K", "output": "Q6_K",
    "blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K", "blk.0.attn_v": "Q6_K", "blk.0.attn_output": "Q5_K",
    "blk.0.ffn_gate": "Q4_K", "blk.0.ffn_up": "Q4_K", "blk.0.ffn_down": "Q6_K",
    "blk.1.attn_q": "Q5_K", "blk.1.attn_k": "Q5_K", "blk.1.attn_v": "Q5_K", "blk.1.attn_output": "Q4_K",
    "blk.1.ffn_gate": "Q6_K", "blk.1.ffn_up": "Q6_K", "blk.1.ffn_down": "Q5_K",
}


def _shape(name: str, vocab: int) -> tuple[int, int]:
    kv = HIDDEN // HEADS * KV_HEADS
    rows = {"token_embd": vocab, "output": vocab, "attn_k": kv, "attn_v": kv, "ffn_gate": FFN, "ffn_up": FFN}
    return rows.get(name.split(".")[-1], HIDDEN), FFN if name.endswith("ffn_down") else HIDDEN


def write_kquant_llama(path: Path, formats: dict[str, str] = FORMATS) -> None:
    """A 2-layer Llama (hidden 256) with SmolLM2's tokenizer, its matrices random blocks of ``formats`` (K-quant
    super-blocks; Q8_0 quantized from random weights)."""
    meta = read_gguf(smollm2_gguf_path()).metadata
    vocab = len(meta["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(meta["tokenizer.chat_template"])
    w.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    for name, fmt in formats.items():
        n, k = _shape(name, vocab)
        scale = 0.1 / 15 / 63 * (1.0 if "blk" in name else 4.0)  # weights of about +-0.1 (embedding +-0.4)
        qtype = getattr(gguf.GGMLQuantizationType, fmt)
        raw = (gguf.quants.quantize(rng.uniform(-0.1, 0.1, (n, k)).astype(np.float32), qtype) if fmt == "Q8_0"
               else random_kquant(fmt, n, k, rng, scale))
        w.add_tensor(f"{name}.weight", raw, raw_dtype=qtype)
        if name.endswith("attn_q"):
            for norm in ("attn_norm", "ffn_norm"):
                w.add_tensor(f"{name[:6]}{norm}.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kquant") / "tiny-kquant.gguf"
    write_kquant_llama(path)
    return path


def decode_logits(model, prompts: list[list[int]], batched: bool) -> list[torch.Tensor]:
    """Prefill each prompt, then one decode step per prompt: all together (``batched``) or one at a time; the
    decode rows' logits, per prompt."""
    pool = KVPool(model.config, 8 * len(prompts), 16, model.dtype)
    pages = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    for ids, p in zip(prompts, pages, strict=True):
        model.forward([SeqChunk(ids, 0, p)], pool)
    chunks = [SeqChunk([ids[-1]], len(ids), p) for ids, p in zip(prompts, pages, strict=True)]
    if batched:
        return list(model.forward(chunks, pool))
    return [model.forward([c], pool)[0] for c in chunks]


@pytest.mark.model
def test_a_kquant_gguf_keeps_its_blocks_and_generates_what_the_dequantized_model_does(kquant_gguf, monkeypatch):
    """Loaded where the C kernels run, the K-quant matrices stay super-blocks (a fused projection of mixed formats
    is dequantized), decode rows take the bf16 expansion (no int8 kernel for K-quants), the logits of a prefill and
    of decode steps equal the dequantized model's bit for bit, so do the greedy tokens, and a decode row's logits
    do not depend on the other rows of its step."""
    if not kernels.detect().block_weights:
        pytest.skip(f"no C kernels here ({kernels.detect().summary()})")
    loaded = load_model(str(kquant_gguf))
    model, weights = loaded.model, loaded.model.weights
    first, second = weights.layers
    assert isinstance(first.qkv, torch.Tensor) and first.qkv.dtype == torch.bfloat16  # Q4_K q/k with a Q6_K v
    assert (second.qkv.fmt, first.o.fmt, first.gate_up.fmt, first.down.fmt) == ("Q5_K", "Q5_K", "Q4_K", "Q6_K")
    assert (weights.embed.fmt, weights.lm_head.fmt, second.gate_up.fmt) == ("Q4_K", "Q6_K", "Q6_K")
    assert not model.backend.decode_int8
    monkeypatch.setenv("KVFENCE_KEEP_BLOCKS", "0")
    dense = load_model(str(kquant_gguf)).model
    assert all(isinstance(w, torch.Tensor) for w in dense.weights.layers[1].matrices)

    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
    prompts = [ids, ids[3:], ids[:5] * 3]
    blocks_logits = decode_logits(model, prompts, batched=True)
    assert all(torch.equal(a, b) for a, b in zip(blocks_logits, decode_logits(dense, prompts, True), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(blocks_logits, decode_logits(model, prompts, False), strict=True))
    tokens = greedy(model, ids, 12)
    assert tokens == greedy(dense, ids, 12)
    assert len(set(tokens)) > 1  # a model whose logits depend on its input


@pytest.mark.model
def test_q8_0_beside_kquants_routes_decode_rows_by_format(tmp_path):
    """A GGUF with Q8_0 attention outputs among K-quants: decode rows multiply the Q8_0 weights in int8 (their
    ``DecodeBlocks`` copies) and the K-quant ones by the bf16 expansion, and a decode row's logits still do not
    depend on the other rows of its step."""
    if not kernels.detect().int8_rows:
        pytest.skip(f"no int8 kernel here ({kernels.detect().summary()})")
    path = tmp_path / "mixed.gguf"
    write_kquant_llama(path, FORMATS | {"blk.0.attn_output": "Q8_0", "blk.1.attn_output": "Q8_0"})
    loaded = load_model(str(path))
    model, backend = loaded.model, loaded.model.backend
    assert backend.decode_int8
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
    prompts = [ids, ids[3:], ids[:5] * 3]
    batched = decode_logits(model, prompts, batched=True)
    q8 = kernels.library().kvf_gemm_q8
    for entries in backend._gemm_entries:  # per layer (qkv, o, gate_up, down): (chunks' entry, decode rows')
        assert [decode[0] is q8 for _, decode in entries] == [False, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(batched, decode_logits(model, prompts, False), strict=True))
    assert len(greedy(model, ids, 6)) == 6
