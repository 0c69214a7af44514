"""The CUDA path (``--device cuda``): the forward against transformers, batch invariance, the engine, and the
colocated and disaggregated servers on a GPU. Skipped where torch sees no GPU (CI, this project's CPU machines);
``scripts/cuda_check.sh`` runs them on one. The float32 comparisons turn TF32 off, so cuBLAS computes in full
float32 like the reference.

Where the weights cannot travel (the bundled GGUF is larger than what a GPU check carries), the speed and
invariance checks use a random-weight Llama with SmolLM2-135M's shapes and tokenizer (``smollm2_shaped_dir``).
"""

from __future__ import annotations

import openai
import pytest
import torch

from kvfence.config import EngineConfig
from kvfence.core import Request, SamplingParams
from kvfence.engine.engine import Engine
from kvfence.kvcache.pool import KVPool
from kvfence.model.loader import load_model
from tests.server import Server
from tests.test_model import CHUNK_REL_TOL, REL_TOL, assert_close, check_invariance, prefill, varied_text
from tests.tiny_models import ARCHS, greedy, smollm2_shaped_dir, tiny_model_dir


def needs_cuda(test):
    """The ``gpu`` mark, and a skip where torch sees no GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


CUDA = "cuda"


@pytest.fixture
def full_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def shaped():
    """bf16 SmolLM2-shaped random model on the GPU."""
    return load_model(str(smollm2_shaped_dir()), dtype=torch.bfloat16, device=CUDA)


@pytest.mark.model
@needs_cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_on_cuda_match_transformers(arch, full_fp32):
    transformers = pytest.importorskip("transformers")
    path = tiny_model_dir(arch)
    ours = load_model(str(path), dtype=torch.float32, device=CUDA)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(CUDA).eval()
    ids = ours.tokenizer.encode(varied_text(250, seed=ARCHS.index(arch)))[:300]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids], device=CUDA)).logits[0].float()
    assert_close(prefill(ours.model, [ids], KVPool(ours.config, 32, 16, torch.float32, CUDA)), ref, REL_TOL)
    pool = KVPool(ours.config, 32, 16, torch.float32, CUDA)  # chunked prefill, then single-token decode steps
    got = prefill(ours.model, [ids[:100], ids[100:290], *[[t] for t in ids[290:]]], pool)
    assert_close(got, ref, CHUNK_REL_TOL)
    prompt = ids[:120]
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([prompt], device=CUDA), attention_mask=torch.ones(1, 120, device=CUDA,
                             dtype=torch.long), max_new_tokens=24, do_sample=False)[0, 120:].tolist()
    assert greedy(ours.model, prompt, 24, eos=frozenset([2])) == theirs


@pytest.mark.model
@needs_cuda
def test_batch_invariance_on_cuda(shaped):
    """cuBLAS picks GEMM kernels by shape like a CPU BLAS: the calibrated row blocks keep each row's bits."""
    check_invariance(shaped, long_prefill=2048, decoders=31)


@pytest.mark.model
@needs_cuda
def test_engine_on_cuda_answers_alike_alone_and_together(shaped):
    cfg = EngineConfig(max_context=1024, kv_pool_tokens=32 * 1024, page_size=16, max_batch=32)
    tok = shaped.tokenizer
    prompts = [tok.encode(varied_text(20 + 7 * i, seed=i)) for i in range(16)]

    def run(batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
        engine = Engine(shaped.model, tok, cfg, torch.bfloat16, CUDA)
        reqs = [Request(p, params) for p in batch]
        for r in reqs:
            engine.add(r)
        while engine.has_work:
            engine.step()
        engine.check_integrity()
        return [r.output_ids for r in reqs]

    greedy_params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    together = run(prompts, greedy_params)
    assert together == [run([p], greedy_params)[0] for p in prompts]
    assert all(len(out) == 24 for out in together)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    assert run(prompts[:3], seeded) == run(prompts[:3], seeded)


@pytest.mark.slow
@needs_cuda
def test_servers_on_cuda_serve_the_openai_client_and_agree():
    """Colocated and disaggregated (shm, staged through host memory) on the GPU: the same greedy answers,
    streaming equal to plain, and the 400 for an over-length prompt."""
    model = str(tiny_model_dir("llama"))
    prompts = ["Repeat exactly: the secret code is ZEBRA-4471.", "What is the capital of France?", "Count to five."]
    answers = []
    for mode in ("colocated", "disaggregated"):
        with Server("--mode", mode, "--device", "cuda", "--model", model, "--max-context", "512") as server:
            client = server.client()
            name = client.models.list().data[0].id
            got = []
            for prompt in prompts:
                messages = [{"role": "user", "content": prompt}]
                plain = client.chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0)
                stream = client.chat.completions.create(model=name, messages=messages, max_tokens=20,
                                                        temperature=0, stream=True)
                streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert plain.usage.completion_tokens > 0 and streamed == plain.choices[0].message.content
                got.append(streamed)
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=name, messages=[{"role": "user", "content": "word " * 600}])
            assert err.value.code == "context_length_exceeded"
            answers.append(got)
    assert answers[0] == answers[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    server = Server("--mode", "colocated", "--device", "cuda", "--model", str(tiny_model_dir("llama")),
                    wait_ready=False)
    assert server.proc.wait(timeout=60) != 0
    assert "--device cuda" in server.log_path.read_text() and "no CUDA GPU" in server.log_path.read_text()
