"""Families beyond Llama/Qwen in Hugging Face format (Mistral, Phi-3, Gemma 2, Gemma 3 text; the mixture-of-experts
Qwen3-MoE and GLM-4-MoE; Qwen3 with yarn rope scaling), each checked against transformers on a tiny random-weight
model built from the family's own config class (``tiny_models.py``: a sliding window of 24 tokens, shorter than most
prompts here; Gemma 3 with two sliding layers and a global one; the MoE models with 8 experts, top 2, and a dense
layer among sparse ones; yarn from 64 positions on, factor 4).

Tolerances, float32 both sides: a prompt's logits in one forward within 2e-5 x the largest logit of
transformers' (measured: 0, the same ops in the same order); chunked prefill and decode steps within 1e-4 x
(measured ~1e-6: other kernels and call sizes). Greedy tokens must be identical. The MoE families are held to the
same tolerances (measured: 0 in one forward, as the others).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvfence.kvcache.pool import KVPool
from kvfence.model import kernels
from kvfence.model.backends import CBackend, TorchBackend, choose_backend
from kvfence.model.describe import hf_arch, hf_config
from kvfence.model.llama import Model
from kvfence.model.loader import LoadedModel, load_model
from tests.server import Server
from tests.test_model import CHUNK_REL_TOL, REL_TOL, assert_close, check_invariance, hf_logits, prefill, varied_text
from tests.tiny_models import FAMILIES, MOE, WINDOW, greedy, tiny_model_dir

transformers = pytest.importorskip("transformers")

CAPS = kernels.detect()
# prompt lengths: shorter and longer than the window, and (for Phi-3's longrope, whose short factors end at 64)
# some whose greedy continuation crosses position 64
LENGTHS = (5, 12, 23, 25, 40, 50, 60, 63)
NEW_TOKENS = 12
LONG = 300  # a prompt many windows long


def prompts(family: str) -> list[list[int]]:
    tok = load(family).tokenizer
    return [tok.encode(varied_text(n, seed=FAMILIES.index(family) * 10 + i))[:n] for i, n in enumerate(LENGTHS)]


_LOADED: dict = {}


def load(family: str, dtype: torch.dtype = torch.float32):
    key = (family, dtype)
    if key not in _LOADED:
        _LOADED[key] = load_model(str(tiny_model_dir(family)), dtype=dtype)
    return _LOADED[key]


_HF: dict = {}


def hf(family: str):
    if family not in _HF:
        _HF[family] = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(family),
                                                                         dtype=torch.float32).eval()
    return _HF[family]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, len(ids) :].tolist()


def hf_stepwise_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, one token per call over its cache, without Phi-3's recompute of the whole cache
    with the long factors when the sequence passes 64 positions (``prepare_inputs_for_generation``)."""
    out: list[int] = []
    with torch.inference_mode():
        step = model(torch.tensor([ids]), use_cache=True)
        while True:
            out.append(int(step.logits[0, -1].argmax()))
            if len(out) == n:
                return out
            step = model(torch.tensor([out[-1:]]), past_key_values=step.past_key_values, use_cache=True)


def hf_stepwise_logits(model, ids: list[int], first: int) -> torch.Tensor:
    """transformers' logits of ``ids``: ``ids[:first]`` in one call, then one token per call over its cache (how
    ``generate`` runs; Phi-3's longrope then rotates each position by its own factors, as kvfence always does)."""
    with torch.inference_mode():
        out = model(torch.tensor([ids[:first]]), use_cache=True)
        rows, cache = [out.logits[0]], out.past_key_values
        for t in ids[first:]:
            out = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(rows).float()


# -- loading and the backend --------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_with_its_features(family):
    cfg = load(family).config
    assert cfg.arch == family.split("-")[0]
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    want = {"mistral": [WINDOW] * 2, "phi3": [WINDOW] * 2, "phi3-plain": [None] * 2, "gemma2": [WINDOW, None],
            "gemma3": [WINDOW, WINDOW, None], "qwen3_moe": [None] * 3, "glm4_moe": [None] * 3,
            "qwen3-yarn": [None] * 2}[family]
    assert windows == want
    if family.startswith("gemma"):
        assert (cfg.hidden_act, cfg.norm_offset, cfg.sandwich_norms, cfg.embed_scale) == ("gelu_tanh", True, True, 8.0)
        assert cfg.query_scale == 24**-0.5
    if family == "gemma2":
        assert (cfg.attn_softcap, cfg.final_softcap) == (3.0, 15.0)
    if family == "gemma3":
        assert cfg.qk_norm and cfg.rope_local_theta == 1000.0 and cfg.rope_scaling["rope_type"] == "linear"
    if family == "phi3":
        assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["factor"] == 4096 / 64
    if family == "qwen3-yarn":
        assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                    "rope_theta": 10000.0}
    if family in MOE:
        assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size) == (8, 2, 32)
        assert cfg.normalize_expert_weights and cfg.qk_norm
    if family == "qwen3_moe":  # mlp_only_layers=[1]
        assert cfg.sparse_layers == (0, 2) and cfg.router_scoring == "softmax" and cfg.rotary_dim is None
    if family == "glm4_moe":  # first_k_dense_replace=1
        assert cfg.sparse_layers == (1, 2) and (cfg.router_scoring, cfg.router_float32) == ("sigmoid", True)
        assert (cfg.expert_groups, cfg.expert_groups_kept, cfg.expert_weight_scale) == (2, 1, 2.5)
        assert cfg.shared_expert_intermediate_size == 32 and cfg.rotary_dim == 8 and cfg.attention_bias
    if family in MOE:
        layers = load(family).model.weights.layers
        for i, layer in enumerate(layers):
            assert (layer.experts is not None) == (i in cfg.sparse_layers) == (layer.gate_up is None)
        e = layers[cfg.sparse_layers[0]].experts
        assert len(e.gate_up) == len(e.down) == 8 and e.gate_up[0].shape == (64, 64) and e.down[0].shape == (64, 32)
        assert (e.shared_gate_up is not None) == (e.choice_bias is not None) == (family == "glm4_moe")
        assert e.router.dtype == torch.float32
        if family == "glm4_moe":
            assert e.choice_bias.abs().min() > 0  # the tiny model's bias is random, so it changes choices
            assert load(family, torch.bfloat16).model.weights.layers[1].experts.router.dtype == torch.float32


@pytest.mark.model
def test_the_c_backend_runs_only_the_configs_it_computes_exactly():
    """Llama's forward with other rope tables or fused weights is the C backend's (Phi-3 without a window, Qwen3
    with yarn, Mistral with a window covering the context); every other feature goes to torch, and the reason is
    said."""
    caps, cpu, bf16 = dataclasses.replace(CAPS, flavour="avx2"), torch.device("cpu"), torch.bfloat16
    for family in FAMILIES:
        cfg = load(family).config
        backend, why = choose_backend(caps, cfg, bf16, cpu)
        exact = family in ("phi3-plain", "qwen3-yarn")
        assert backend is (CBackend if exact else TorchBackend), family
        assert ("exactly" in why) == exact, why
        assert ("mixture-of-experts" in why) == (family in MOE), why
    mistral = load("mistral").config
    assert "sliding-window" in choose_backend(caps, mistral, bf16, cpu)[1]
    assert choose_backend(caps, dataclasses.replace(mistral, sliding_window=mistral.max_context), bf16, cpu)[0] \
        is CBackend
    assert "gelu_tanh" in choose_backend(caps, dataclasses.replace(load("gemma2").config, sliding_window=None),
                                         bf16, cpu)[1]


@pytest.mark.model
def test_the_window_changes_what_the_model_computes():
    """The tiny models' window really acts: without it, a prompt longer than the window gets other logits."""
    loaded = load("mistral")
    ids = prompts("mistral")[-1]
    pool = KVPool(loaded.config, 8, 16, torch.float32)
    windowed = prefill(loaded.model, [ids], pool)
    cfg = dataclasses.replace(loaded.config, sliding_window=None)
    plain = prefill(Model(cfg, loaded.model.weights, TorchBackend(cfg, loaded.model.weights, CAPS)), [ids],
                    KVPool(cfg, 8, 16, torch.float32))
    assert torch.equal(windowed[:WINDOW], plain[:WINDOW])  # the first window sees the whole prefix either way
    assert (windowed[WINDOW:] - plain[WINDOW:]).abs().max() > 0.1


@pytest.mark.fast
def test_unknown_architectures_are_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported .*Gemma2ForCausalLM.*Gemma3ForCausalLM"
                       ".*MistralForCausalLM.*Phi3ForCausalLM"):
        hf_arch({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="sliding-window"):
        hf_arch({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True})
    with pytest.raises(ValueError, match="bidirectional"):
        hf_arch({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="partial rotary"):
        hf_arch({"architectures": ["Phi3ForCausalLM"], "rope_parameters": {"partial_rotary_factor": 0.75}})
    with pytest.raises(ValueError, match="partial rotary"):
        hf_arch({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75})  # Phi-4-mini's config.json
    with pytest.raises(ValueError, match="activation 'gelu'"):
        hf_arch({"architectures": ["MistralForCausalLM"], "hidden_act": "gelu"})


@pytest.mark.fast
def test_moe_options_kvfence_does_not_compute_are_refused_in_one_line():
    qwen, glm = {"architectures": ["Qwen3MoeForCausalLM"]}, {"architectures": ["Glm4MoeForCausalLM"]}
    assert (hf_arch(qwen), hf_arch({**glm, "partial_rotary_factor": 0.5})) == ("qwen3_moe", "glm4_moe")
    for raw, match in [
        ({**qwen, "scoring_func": "sigmoid"}, "routing other than the family's \\(softmax\\)"),
        ({**glm, "scoring_func": "softmax"}, "routing other than the family's \\(sigmoid noaux_tc\\)"),
        ({**glm, "topk_method": "greedy"}, "noaux_tc"),
        ({**glm, "n_routed_experts": 8, "n_group": 3}, "expert groups must split the 8 experts"),
        ({**glm, "n_routed_experts": 8, "n_group": 2, "topk_group": 3}, "topk_group"),
        ({**qwen, "shared_expert_intermediate_size": 64}, "gated shared experts"),
        ({**qwen, "use_sliding_window": True}, "sliding-window"),
        ({**qwen, "partial_rotary_factor": 0.5}, "partial rotary"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            hf_arch(raw)
        assert "\n" not in str(err.value)


@pytest.mark.fast
@pytest.mark.parametrize("params", [
    dict(factor=4.0, original_max_position_embeddings=64),
    dict(factor=8, original_max_position_embeddings=64, beta_fast=16, beta_slow=2, truncate=False),
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707),  # DeepSeek's
    dict(factor=2.0, original_max_position_embeddings=128, attention_factor=1.3),
], ids=["defaults", "betas-untruncated", "mscale", "attention-factor"])
def test_yarn_is_transformers_bit_for_bit(params):
    """The yarn frequencies and attention factor of each option config.json can set, for two head sizes and rope
    bases, are those of transformers' ``_compute_yarn_parameters``."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from kvfence.model.llama import _yarn

    for head_dim, theta in [(32, 10000.0), (64, 1e6)]:
        cfg = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=head_dim,
                                       max_position_embeddings=int(params["factor"] * 64),
                                       rope_parameters=dict(rope_type="yarn", rope_theta=theta, **params))
        want, want_factor = _compute_yarn_parameters(cfg)
        got, factor = _yarn(params, theta, torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim,
                            head_dim)
        assert torch.equal(got, want) and factor == want_factor, (head_dim, theta)


@pytest.mark.fast
def test_yarn_lengths_are_read_as_transformers_and_other_rope_scalings_refused_in_one_line():
    """A top-level ``original_max_position_embeddings`` comes before the one in ``rope_scaling``, and a missing
    factor is the ratio of the contexts (transformers' ``standardize_rope_params``); ``dynamic`` is refused."""
    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 4096,
           "original_max_position_embeddings": 1024}
    yarn = hf_config(raw | {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 2048}}, {})
    assert yarn.rope_scaling == {"type": "yarn", "rope_type": "yarn", "original_max_position_embeddings": 1024,
                                 "factor": 4.0}
    with pytest.raises(ValueError, match="Qwen3ForCausalLM: rope scaling 'dynamic' is not supported") as err:
        hf_config(raw | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, {})
    assert "\n" not in str(err.value)


@pytest.mark.model
def test_moe_experts_load_from_stacked_names_too(tmp_path):
    """transformers' in-memory layout (``mlp.experts.gate_up_proj`` ``[E, 2 F, hidden]``, ``mlp.experts.down_proj``
    ``[E, hidden, F]``) loads to the same logits as the per-expert names hub checkpoints use."""
    import shutil

    from safetensors.torch import load_file, save_file

    for family in MOE:
        src, dst = tiny_model_dir(family), tmp_path / family
        shutil.copytree(src, dst)
        sd, stacked = load_file(str(src / "model.safetensors")), {}
        for name, w in sd.items():
            head, sep, rest = name.partition(".mlp.experts.")
            if not sep:
                stacked[name] = w
            elif rest.startswith("0.") and rest.endswith("down_proj.weight"):  # once per layer
                gate, up, down = ([sd[f"{head}.mlp.experts.{e}.{p}_proj.weight"] for e in range(8)]
                                  for p in ("gate", "up", "down"))
                stacked[f"{head}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u])
                                                                           for g, u in zip(gate, up, strict=True)])
                stacked[f"{head}.mlp.experts.down_proj"] = torch.stack(down)
        save_file(stacked, str(dst / "model.safetensors"))
        ids = prompts(family)[-1]
        got = load_model(str(dst), dtype=torch.float32)
        want = prefill(load(family).model, [ids], KVPool(got.config, 8, 16, torch.float32))
        assert torch.equal(prefill(got.model, [ids], KVPool(got.config, 8, 16, torch.float32)), want)


# -- against transformers -----------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    """A prompt of many windows: in one forward, and in chunks then single-token decode steps. Phi-3's reference
    runs as ``generate`` does past its 64 short-factor positions (``hf_stepwise_logits``)."""
    loaded, ref_model = load(family), hf(family)
    ids = loaded.tokenizer.encode(varied_text(250, seed=7))[:LONG]
    ref = hf_stepwise_logits(ref_model, ids, 60) if family == "phi3" else hf_logits(ref_model, ids)
    whole = prefill(loaded.model, [ids], KVPool(loaded.config, 32, 16, torch.float32))
    if family != "phi3":  # one call over 300 positions rotates them all with the long factors in transformers
        assert_close(whole, ref, REL_TOL)
    chunked = prefill(loaded.model, [ids[:10], ids[10:60], ids[60:250], *[[t] for t in ids[250:]]],
                      KVPool(loaded.config, 32, 16, torch.float32))
    assert_close(chunked, ref, CHUNK_REL_TOL)


@pytest.mark.model
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_generate(family):
    """Eight prompts, most longer than the window. Phi-3's ``generate`` recomputes every position with the long
    factors once a sequence passes 64 positions; kvfence keeps each position's table (``llama._rope_tables``), so
    past 64 its tokens are checked against transformers run one token at a time (``hf_stepwise_greedy``)."""
    loaded, ref_model = load(family), hf(family)
    crossed = 0
    for ids in prompts(family):
        ours = greedy(loaded.model, ids, NEW_TOKENS)
        if family == "phi3" and len(ids) + NEW_TOKENS > 64:
            crossed += 1
            assert ours[: 64 - len(ids)] == hf_greedy(ref_model, ids, 64 - len(ids)), len(ids)
            assert ours == hf_stepwise_greedy(ref_model, ids, NEW_TOKENS), len(ids)
        else:
            assert ours == hf_greedy(ref_model, ids, NEW_TOKENS), len(ids)
    assert crossed == (2 if family == "phi3" else 0)


# -- the engine and batch invariance ------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_chunked_and_paged_gives_the_tokens_of_one_forward(family):
    """All eight prompts at once through the engine (pages of 16, prefill chunks of 16 tokens, decode batched with
    the other prompts' chunks) give the tokens of each prompt prefilled in one forward and decoded alone."""
    from kvfence.llm import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir(family)), dtype="float32", max_model_len=256, chunk_size=16)
    ids = prompts(family)
    got = llm.generate(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    model = llm.loaded.model
    assert [r.outputs[0].token_ids for r in got] == [greedy(model, p, NEW_TOKENS, chunk=len(p)) for p in ids]


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_invariance(family, dtype):
    """test_model's check on each family: a chunk's logits are bit-identical whatever shares its step (decodes
    at 300 positions, a chunk after 300, a fresh prefill of 50 and a 400-token prefill: all past the window)."""
    loaded = load(family, dtype)
    check_invariance(loaded, long_prefill=400, decoders=15)
    if dtype == torch.bfloat16 and CAPS.flavour:  # the torch ops alone too, where the load took the C matmuls
        cfg, w = loaded.config, loaded.model.weights
        alone = dataclasses.replace(loaded, model=Model(cfg, w, TorchBackend(cfg, w, dataclasses.replace(
            CAPS, flavour=None))))
        check_invariance(alone, long_prefill=400, decoders=15)


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", MOE)
def test_a_moe_row_routes_and_sums_alone(family, dtype):
    """The MoE block on its own: 300 rows that choose every expert, each row's output is bit-identical to that row
    computed alone (where it is its experts' only row), and the experts' row counts differ between the two."""
    from kvfence.model.backends.torch import route

    loaded = load(family, dtype)
    cfg, backend = loaded.config, loaded.model.backend
    e = loaded.model.weights.layers[cfg.sparse_layers[-1]].experts
    x = torch.randn(300, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)  # [300, hidden]
    with torch.inference_mode():
        chosen = route(cfg, backend._linear(x, e.router), e.choice_bias)[1]  # [300, k]
        assert chosen.unique().tolist() == list(range(cfg.num_experts))
        together = backend._moe(e, x)  # [300, hidden]
        for i in range(0, 300, 7):
            assert torch.equal(backend._moe(e, x[i : i + 1])[0], together[i]), i


# -- served ------------------------------------------------------------------------------------------------------

SERVE = ("--max-context", "512", "--kv-pool-tokens", "2048", "--chunk-size", "32")


def completion_ids(server: Server, model: str, prompt: list[int]) -> str:
    reply = server.client().completions.create(model=model, prompt=prompt, temperature=0, max_tokens=NEW_TOKENS,
                                               extra_body={"ignore_eos": True})
    return reply.choices[0].text


def check_served(path: Path, loaded: LoadedModel, ids: list[list[int]]) -> None:
    """Over HTTP with the openai client, ``kvfence serve --model path``: colocated gives the text of ``loaded``'s
    in-process greedy tokens for each prompt of ``ids`` (``loaded``: ``path`` in bf16, the dtype and backend a worker
    loads; prefill chunks of 32), and 1 prefill + 1 decode worker (real processes, shm) give exactly colocated's."""
    want = [loaded.tokenizer.decode(greedy(loaded.model, p, NEW_TOKENS, chunk=32)) for p in ids]
    with Server("--mode", "colocated", "--model", str(path), *SERVE) as server:
        colocated = [completion_ids(server, loaded.name, p) for p in ids]
    assert colocated == want
    with Server("--model", str(path), "--prefill", "1", "--decode", "1", *SERVE) as server:
        assert [completion_ids(server, loaded.name, p) for p in ids] == colocated


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_served_colocated_and_disaggregated_give_the_models_tokens(family):
    """``check_served`` on the family's HF directory: prompts of 1 and 2 chunks, below and past the window."""
    check_served(tiny_model_dir(family), load(family, torch.bfloat16),
                 [prompts(family)[i] for i in (2, 5, 7)])  # 23, 50 and 63 tokens
