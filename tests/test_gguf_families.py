"""GGUF architectures beyond the bundled SmolLM2: each family's tiny random-weight HF model
(``tests/tiny_models.py``, built with transformers' own config class) converted to a GGUF as llama.cpp converts it
(``tests/gguf_convert.py``: its names, llama's Q/K permutation, llama3's ``rope_freqs`` factors, Phi-3's fused
tensors and longrope factors, yarn's ``rope.scaling`` keys, stacked experts, Mistral as ``llama`` without its window)
loads through kvfence and gives the greedy tokens of the HF directory loaded through kvfence (which ``test_model.py``
and ``test_families.py`` check against transformers).

Tolerance, float32: logits within 1e-5 x the largest logit of the HF directory's (measured: identical for every
family but those whose rope factors llama.cpp stores in float32, llama3 and Phi-3's attention factor, where the
rope tables differ in the last bits).

The MoE families with their stacked experts quantized (Q4_1, Q8_0) keep each expert's weights as blocks in bf16
and compute, bit for bit, what the same file dequantized at load computes.

Served (``test_families.check_served``): the GGUFs of Gemma 2, Phi-3 and Qwen3-MoE (its experts Q4_1/Q8_0) give, over
HTTP, colocated the in-process greedy tokens of the file in bf16, and disaggregated exactly colocated's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvfence.kvcache.pool import KVPool
from kvfence.model import kernels
from kvfence.model.backends.torch import route
from kvfence.model.blocks import BlockWeight
from kvfence.model.gguf_file import read_gguf
from kvfence.model.loader import load_model
from tests.gguf_convert import write_gguf
from tests.test_families import check_served
from tests.test_kquants import decode_logits
from tests.test_model import assert_close, prefill, varied_text
from tests.tiny_models import EXTRA, TINY, WINDOW, greedy, tiny_model_dir, write_model

pytest.importorskip("transformers")

# family -> the tiny HF model: tiny_models' own, or one with what llama.cpp's file format can say (Qwen3-MoE: every
# layer sparse; GLM-4-MoE: one expert group; Gemma: the query scale head_dim ** -0.5; Gemma 3: five sliding layers
# of six, their rope base 10000; Mistral: no sliding window, as llama.cpp computes a Mistral GGUF)
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
VARIANTS = {
    "qwen3_moe": dict(mlp_only_layers=[]),
    "glm4_moe": dict(n_group=1, topk_group=1),
    "mistral": dict(sliding_window=None),
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=GEMMA3_LAYERS,
                   rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0, rope_theta=100000.0),
                                        sliding_attention=dict(rope_type="default", rope_theta=10000.0))),
}
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "phi3-plain", "gemma2", "gemma3", "glm4_moe", "mistral",
            "qwen3-yarn")
GGUF_ARCHS = {"mistral": "llama"}  # kvfence's arch of a GGUF where llama.cpp converts a family as another
REL_TOL = 1e-5
LENGTHS = (5, 12, 23, 25, 40, 50, 60, 63)


def hf_model(family: str, root) -> Path:
    """The family's tiny HF directory, as llama.cpp's file format can say it (``VARIANTS``: written under root)."""
    if family not in VARIANTS:
        return tiny_model_dir(family)
    write_model({**TINY, **EXTRA[family], **VARIANTS[family]}, family, 11, torch.float32, root / family)
    return root / family


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF directory, its GGUF)."""
    root, out = tmp_path_factory.mktemp("gguf"), {}
    for family in FAMILIES:
        hf_dir = hf_model(family, root)
        out[family] = hf_dir, write_gguf(hf_dir, root / f"{family}.gguf")
    return out


@pytest.mark.model
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_gives_the_hf_directorys_tokens(converted, family):
    hf_dir, path = converted[family]
    want, got = (load_model(str(p), dtype=torch.float32) for p in (hf_dir, path))
    arch = family.split("-")[0]  # phi3-plain, qwen3-yarn: variants of phi3 and qwen3
    assert (want.config.arch, got.config.arch) == (arch, GGUF_ARCHS.get(arch, arch))
    assert [got.config.window(i) for i in range(got.config.num_layers)] == [
        want.config.window(i) for i in range(want.config.num_layers)]
    for field in ("rope_local_theta", "rope_theta", "query_scale", "attn_softcap", "final_softcap",
                  "embed_scale", "num_layers", "num_heads", "num_kv_heads", "head_dim", "sliding_window", "qk_norm",
                  "attention_bias", "sparse_layers", "num_experts", "experts_per_token", "rotary_dim",
                  "normalize_expert_weights", "expert_weight_scale", "shared_expert_intermediate_size",
                  "tie_word_embeddings"):
        assert getattr(got.config, field) == getattr(want.config, field), field
    assert got.tokenizer.encode("x = 12 ü") == want.tokenizer.encode("x = 12 ü")
    if family == "qwen3-yarn":  # llama.cpp's yarn with the defaults of transformers': the same tables
        assert got.config.rope_scaling["rope_type"] == "yarn"
        assert torch.equal(got.model.cos, want.model.cos) and torch.equal(got.model.sin, want.model.sin)
    ids = want.tokenizer.encode(varied_text(250, seed=3))[:300]  # past llama3's 256 and Phi-3's 64 positions
    logits = [prefill(m.model, [ids], KVPool(m.config, 32, 16, torch.float32)) for m in (want, got)]
    assert_close(logits[1], logits[0], REL_TOL)
    for i, n in enumerate(LENGTHS):
        prompt = want.tokenizer.encode(varied_text(n, seed=i))[:n]
        assert greedy(got.model, prompt, 12) == greedy(want.model, prompt, 12), n


# family -> the formats of its stacked experts (gguf_convert's ``formats``): GLM's layer 2 fuses a Q8_0 gate with a
# Q4_1 up, so its gate_up is dequantized at load; its down (Q4_1: one block per row, an odd last one) stays blocks
EXPERT_FORMATS = {
    "qwen3_moe": {"ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0"},
    "glm4_moe": {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_1", "blk.2.ffn_up_exps": "Q4_1"},
}


def expert_matrices(model) -> dict[str, torch.Tensor | BlockWeight]:
    """``blk.N.gate_up.E`` / ``blk.N.down.E`` -> each sparse layer's expert weights, as the model holds them."""
    out = {}
    for i, layer in enumerate(model.weights.layers):
        for e, (gate_up, down) in enumerate(zip(layer.experts.gate_up, layer.experts.down, strict=True)
                                            if layer.experts else ()):
            out |= {f"blk.{i}.gate_up.{e}": gate_up, f"blk.{i}.down.{e}": down}
    return out


@pytest.mark.model
@pytest.mark.parametrize("family", sorted(EXPERT_FORMATS))
def test_quantized_stacked_experts_stay_blocks_and_compute_what_dequantized_ones_do(tmp_path, monkeypatch, family):
    """A GGUF whose stacked experts are Q4_1/Q8_0, loaded in bf16: each expert's gate_up and down are blocks of its
    format (the GGUF's bytes, not bf16's) but a gate_up fused from two formats; the prefill and decode logits and the
    greedy tokens equal, bit for bit, those of the same file dequantized at load (``KVFENCE_KEEP_BLOCKS=0``, the
    loading before blocks were kept), and a row's MoE output and logits do not depend on the rows beside it."""
    if not kernels.detect().block_weights:
        pytest.skip(f"bf16 block weights need the C kernels, absent here ({kernels.detect().summary()})")
    formats = EXPERT_FORMATS[family]
    path = write_gguf(hf_model(family, tmp_path), tmp_path / f"{family}.gguf", formats)
    loaded = load_model(str(path))
    model, cfg = loaded.model, loaded.config
    assert model.backend.name.startswith("torch+c-")
    held = expert_matrices(model)
    assert len(held) == 2 * len(cfg.sparse_layers) * cfg.num_experts
    gguf_bytes = {t.name.removesuffix(".weight"): t.nbytes for t in read_gguf(path).tensors if "_exps" in t.name}
    for i in cfg.sparse_layers:
        gate, up, down = (formats.get(f"blk.{i}.ffn_{p}_exps", formats[f"ffn_{p}_exps"])
                          for p in ("gate", "up", "down"))
        fused = [held[f"blk.{i}.gate_up.{e}"] for e in range(cfg.num_experts)]
        downs = [held[f"blk.{i}.down.{e}"] for e in range(cfg.num_experts)]
        assert all(isinstance(w, BlockWeight) and w.fmt == down for w in downs), i
        assert sum(w.nbytes for w in downs) == gguf_bytes[f"blk.{i}.ffn_down_exps"]  # the quantized bytes
        if gate == up:
            assert all(isinstance(w, BlockWeight) and w.fmt == gate for w in fused), i
            assert sum(w.nbytes for w in fused) == gguf_bytes[f"blk.{i}.ffn_gate_exps"] + gguf_bytes[
                f"blk.{i}.ffn_up_exps"]
        else:
            assert all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 for w in fused), i

    monkeypatch.setenv("KVFENCE_KEEP_BLOCKS", "0")
    dense = load_model(str(path)).model
    assert all(isinstance(w, torch.Tensor) for w in expert_matrices(dense).values())
    bf16_bytes = sum(w.nbytes for w in expert_matrices(dense).values())
    assert sum(w.nbytes for w in held.values()) < bf16_bytes / (1.6 if family == "glm4_moe" else 2.5)

    ids = loaded.tokenizer.encode(varied_text(60, seed=5))[:70]
    chunks = [ids[:40], ids[40:]]
    assert torch.equal(*(prefill(m, chunks, KVPool(cfg, 8, 16, torch.bfloat16)) for m in (model, dense)))
    prompts = [ids, ids[3:30], ids[:5] * 3]
    batched = decode_logits(model, prompts, batched=True)
    assert all(torch.equal(a, b) for a, b in zip(batched, decode_logits(dense, prompts, True), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(batched, decode_logits(model, prompts, False), strict=True))
    for n in (7, 23, 50):
        tokens = greedy(model, ids[:n], 10)
        assert tokens == greedy(dense, ids[:n], 10), n
        assert len(set(tokens)) > 1, n  # a model whose tokens depend on its input

    e = model.weights.layers[cfg.sparse_layers[-1]].experts  # the MoE block alone: 300 rows choosing every expert
    x = torch.randn(300, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.inference_mode():
        chosen = route(cfg, model.backend._linear(x, e.router), e.choice_bias)[1]  # [300, k]
        assert chosen.unique().tolist() == list(range(cfg.num_experts))
        together = model.backend._moe(e, x)  # [300, hidden]
        assert all(torch.equal(model.backend._moe(e, x[i : i + 1])[0], together[i]) for i in range(0, 300, 7))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen3_moe"])
def test_served_gguf_colocated_and_disaggregated_give_the_models_tokens(tmp_path, family):
    """``check_served`` on a dense family's GGUF other than Llama's (Gemma 2: its soft caps and alternating window;
    Phi-3: fused tensors, longrope and a window) and on Qwen3-MoE's with its stacked experts in Q4_1 and Q8_0
    (``EXPERT_FORMATS``): prompts of 1 and 2 chunks, below and past the window."""
    path = write_gguf(hf_model(family, tmp_path), tmp_path / f"{family}.gguf", EXPERT_FORMATS.get(family))
    loaded = load_model(str(path), dtype=torch.bfloat16)
    assert loaded.config.arch == family
    if family in EXPERT_FORMATS and kernels.detect().block_weights:  # the experts are served as the file's blocks
        assert all(isinstance(w, BlockWeight) for w in expert_matrices(loaded.model).values())
    ids = [loaded.tokenizer.encode(varied_text(n, seed=i))[:n] for i, n in enumerate((23, 50, 63))]
    check_served(path, loaded, ids)


@pytest.mark.model
def test_a_mistral_gguf_is_llama_without_the_window(tmp_path):
    """llama.cpp converts MistralForCausalLM as ``llama`` and writes no sliding window (its llama loader would read
    none): the windowed tiny Mistral's GGUF attends to every position, as llama.cpp computes it, so it matches the HF
    model over the first window and differs past it."""
    hf_dir = tiny_model_dir("mistral")
    path = write_gguf(hf_dir, tmp_path / "mistral.gguf")
    meta = read_gguf(path).metadata
    assert meta["general.architecture"] == "llama" and not [k for k in meta if "sliding_window" in k]
    want, got = (load_model(str(p), dtype=torch.float32) for p in (hf_dir, path))
    assert (want.config.sliding_window, got.config.sliding_window, got.config.arch) == (WINDOW, None, "llama")
    ids = want.tokenizer.encode(varied_text(100, seed=5))[:60]
    windowed, full = (prefill(m.model, [ids], KVPool(m.config, 8, 16, torch.float32)) for m in (want, got))
    assert_close(full[:WINDOW], windowed[:WINDOW], REL_TOL)
    assert (full[WINDOW:] - windowed[WINDOW:]).abs().max() > 0.1


@pytest.mark.fast
def test_unsupported_gguf_architecture_and_rope_scaling_are_refused(tmp_path):
    from kvfence.model.gguf_arch import gguf_config
    from kvfence.model.gguf_file import read_gguf
    from tests.gguf_convert import write_fields

    base = {"tokenizer.ggml.tokens": ["a"], "embedding_length": 8, "attention.head_count": 2, "block_count": 1,
            "feed_forward_length": 8, "context_length": 64}
    path = write_fields(tmp_path / "m.gguf", "falcon", {f"falcon.{k}" if "." not in k or k.startswith("attention")
                                                          else k: v for k, v in base.items()})
    with pytest.raises(ValueError, match="m.gguf: GGUF architecture 'falcon' is not supported .*qwen3moe"):
        gguf_config(read_gguf(path))
    fields = {k if k.startswith("tokenizer") else f"llama.{k}": v for k, v in base.items()}
    path = write_fields(tmp_path / "d.gguf", "llama", fields | {"llama.rope.scaling.type": "dynamic"})
    with pytest.raises(ValueError, match="rope scaling 'dynamic' is not supported"):
        gguf_config(read_gguf(path))
    yarn = fields | {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    assert gguf_config(read_gguf(write_fields(tmp_path / "y.gguf", "llama", yarn))).rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "attention_factor": 0.1 * math.log(4.0) + 1}
    # llama.cpp's llama loader reads no yarn_* key: a file asking for other betas than its 32 and 1 is refused
    path = write_fields(tmp_path / "b.gguf", "llama", yarn | {"llama.rope.scaling.yarn_beta_fast": 16.0})
    with pytest.raises(ValueError, match="b.gguf: GGUF rope.scaling.yarn_beta_fast 16 is not supported") as err:
        gguf_config(read_gguf(path))
    assert "\n" not in str(err.value)
