"""Test fixtures: tiny random-weight HF model directories (llama, qwen2, qwen3, and the families of ``FAMILIES``)
and the real SmolLM2, loaded once.

``tiny_model_dir(arch)`` writes, once per machine and version of the code that builds it (cached under the temp
dir, atomically), a directory with ``config.json``, ``model.safetensors``, ``tokenizer.json`` (SmolLM2's real
tokenizer, vocab 49152), ``tokenizer_config.json`` (chat template, bos/eos) and ``generation_config.json``.
Weights are random but not trivial (norm weights and biases randomized), so a wrong layout shows up in the
logits. Each loads in well under a second with ``load_model(str(path))``.

``smollm2(dtype)`` loads the bundled SmolLM2 GGUF once per process and dtype.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from kvfence.model import tokenizer as tokenizer_module
from kvfence.model.loader import LoadedModel, load_model, read_gguf_metadata, smollm2_gguf_path
from kvfence.model.tokenizer import Tokenizer

ARCHS = ("llama", "qwen2", "qwen3")
# the families beyond Llama/Qwen (tests/test_families.py); "phi3-plain" is Phi-3 without rope scaling or window,
# "qwen3-yarn" Qwen3 with yarn rope scaling
FAMILIES = ("mistral", "phi3", "phi3-plain", "gemma2", "gemma3", "qwen3_moe", "glm4_moe", "qwen3-yarn")
MOE = ("qwen3_moe", "glm4_moe")  # the mixture-of-experts families among them
WINDOW = 24  # the tiny families' sliding window, shorter than most test prompts
# the cache is keyed by the code that writes it, so a change to either file rebuilds it
_KEY = hashlib.sha256(Path(__file__).read_bytes() + Path(tokenizer_module.__file__).read_bytes()).hexdigest()[:12]
_CACHE = Path(tempfile.gettempdir()) / f"kvfence-test-models-{_KEY}"

TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.2,  # peaked logits: greedy choices are not near-ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# llama: tied embeddings, llama3 rope scaling; qwen2: q/k/v bias, untied; qwen3: q/k norm, head_dim != hidden/heads
EXTRA = {
    "llama": dict(
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
    ),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(tie_word_embeddings=False, head_dim=32),
    # mistral: a window shorter than the prompts; phi3: fused q/k/v and gate/up, longrope (short factors up to 64
    # positions, long ones after) and a window; gemma2: sandwich (1 + w) norms, GeGLU, scaled embeddings, a query
    # scale of its own, soft caps that bite, every other layer windowed; gemma3: q/k norms, two sliding layers and
    # a global one, the sliding layers' own rope theta, linear rope scaling on the global layer
    "mistral": dict(tie_word_embeddings=False, sliding_window=WINDOW),
    "phi3": dict(
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        original_max_position_embeddings=64,
        rope_scaling=dict(
            type="longrope",
            short_factor=[1.0 + 0.05 * i for i in range(8)],
            long_factor=[1.5 + 0.5 * i for i in range(8)],
        ),
    ),
    "phi3-plain": dict(tie_word_embeddings=False, sliding_window=None),
    # qwen3-yarn: yarn from 64 positions on (factor 4; the test prompts and their continuations go past 64)
    "qwen3-yarn": dict(
        tie_word_embeddings=False,
        head_dim=32,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    ),
    "gemma2": dict(
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=15.0,
    ),
    "gemma3": dict(
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=2.0, rope_theta=100000.0),
            sliding_attention=dict(rope_type="default", rope_theta=1000.0),
        ),
    ),
    # qwen3_moe: 8 experts of 32, top 2 renormalized, q/k norms, layers sparse-dense-sparse (mlp_only_layers);
    # glm4_moe: 8 experts in 2 groups of which the best holds both chosen, a random choice bias, a shared expert,
    # weights scaled by 2.5, a dense first layer, q/k/v bias, q/k norms, rope on half of each head
    "qwen3_moe": dict(
        num_hidden_layers=3,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "glm4_moe": dict(
        num_hidden_layers=3,
        head_dim=16,
        tie_word_embeddings=False,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
    ),
}
_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
            "phi3": "Phi3Config", "phi3-plain": "Phi3Config", "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig",
            "qwen3_moe": "Qwen3MoeConfig", "glm4_moe": "Glm4MoeConfig", "qwen3-yarn": "Qwen3Config"}


# SmolLM2-135M's shapes (docs/models.md), for speed and batch-invariance checks where its weights cannot travel
SMOLLM2_SHAPE = dict(
    TINY,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    tie_word_embeddings=True,
)


@functools.cache
def smollm2(dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct, loaded once per process and dtype."""
    return load_model("smollm2-135m", dtype=dtype)


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer from the GGUF (reads metadata only; ~3 s once per process)."""
    return Tokenizer.from_gguf_fields(read_gguf_metadata(smollm2_gguf_path())[0])


def tiny_model_dir(arch: str) -> Path:
    """Path of the tiny ``arch`` model directory, creating it (once per machine) if needed."""
    path = _CACHE / arch
    if not (path / "model.safetensors").exists():
        _atomic_dir(path, lambda tmp: _write_tiny_model(arch, tmp))
    return path


def smollm2_shaped_dir() -> Path:
    """A random-weight bf16 Llama with SmolLM2-135M's shapes and tokenizer (created once per machine)."""
    path = _CACHE / "smollm2-shaped"
    if not (path / "model.safetensors").exists():
        _atomic_dir(path, lambda tmp: write_model(SMOLLM2_SHAPE, "llama", 7, torch.bfloat16, tmp))
    return path


def tokenizer_files_dir() -> Path:
    """A directory holding only SmolLM2's ``tokenizer.json`` + ``tokenizer_config.json`` (built from the GGUF)."""
    path = _CACHE / "tokenizer"
    if not (path / "tokenizer.json").exists():
        _atomic_dir(path, _write_tokenizer)
    return path


def _atomic_dir(path: Path, fill) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        fill(tmp)
        os.rename(tmp, path)  # fails if another process won the race; theirs is as good
    except OSError:
        if not (path / "tokenizer_config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_tokenizer(path: Path) -> None:
    tok = smollm2_tokenizer()
    tok.backend.save(str(path / "tokenizer.json"))
    config = dict(
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        pad_token=tok.eos_token,
        unk_token="<|endoftext|>",
        chat_template=tok.chat_template,
        add_bos_token=False,
        model_max_length=8192,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _write_tiny_model(arch: str, path: Path) -> None:
    write_model({**TINY, **EXTRA[arch]}, arch, (ARCHS + FAMILIES).index(arch), torch.float32, path)


def write_model(params: dict, arch: str, seed: int, dtype: torch.dtype, path: Path) -> None:
    """A random-weight ``arch`` model of ``params`` (seeded), in Hugging Face layout with a tokenizer, at ``path``."""
    import transformers

    cls = getattr(transformers, _CONFIGS[arch])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**params), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # glm4_moe's choice bias (zeros at init)
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    src = tokenizer_files_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, path / f)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2]}))


def greedy(
    model, ids: list[int], max_new: int, eos: frozenset[int] = frozenset(), chunk: int = 512, page_size: int = 16
) -> list[int]:
    """Greedy continuation of ``ids`` with ``Model.forward``: prefill in ``chunk``-token chunks, then decode.

    Uses a private KVPool and pages 0, 1, 2, ... in order; stops after ``max_new`` tokens or an ``eos`` token
    (which is included).
    """
    from kvfence.kvcache.pool import KVPool
    from kvfence.model.batch import SeqChunk

    total = len(ids) + max_new
    pool = KVPool(model.config, -(-total // page_size), page_size, model.dtype, model.device)
    pages = list(range(pool.num_pages))
    for start in range(0, len(ids), chunk):
        logits = model.forward([SeqChunk(ids[start : start + chunk], start, pages)], pool)
    out: list[int] = []
    while True:
        out.append(int(logits[0].argmax()))
        if len(out) == max_new or out[-1] in eos:
            return out
        logits = model.forward([SeqChunk(out[-1:], len(ids) + len(out) - 1, pages)], pool)
