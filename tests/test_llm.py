"""``from kvfence import LLM, SamplingParams``: the colocated engine in-process, as vLLM's offline API."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfence import LLM, SamplingParams
from kvfence.core import ContextLengthExceeded
from tests.server import ROOT, Server
from tests.tiny_models import tiny_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(tiny_model_dir("llama")), max_model_len=256)


@pytest.mark.slow
def test_generate_matches_the_server_token_for_token(llm):
    prompts = ["Once upon a time", "The quick brown fox", [5, 6, 7, 8]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outs] == ["Once upon a time", "The quick brown fox", None]
    assert all(len(o.outputs[0].token_ids) == 8 and o.outputs[0].finish_reason == "length" for o in outs)
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]  # batch invariance
    assert [o.outputs[0].token_ids for o in outs] == alone
    with Server("--mode", "colocated", "--model", str(tiny_model_dir("llama")), "--max-context", "256") as server:
        served = server.client().completions.create(model="llama", prompt="Once upon a time", max_tokens=8,
                                                     temperature=0, extra_body={"ignore_eos": True})
    assert served.choices[0].text == outs[0].outputs[0].text


@pytest.mark.model
def test_chat_and_limits(llm):
    [out] = llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert len(out.outputs[0].token_ids) == 8
    assert len(llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], GREEDY)) == 2
    with pytest.raises(ContextLengthExceeded):
        llm.generate("x " * 300, GREEDY)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1).for_engine()
    with pytest.raises(ValueError, match="pool"):
        LLM(str(tiny_model_dir("llama")), max_model_len=256, kv_pool_tokens=64)  # L0: the pool cannot hold it


@pytest.mark.slow
def test_importing_kvfence_loads_no_torch():
    run = subprocess.run([sys.executable, "-c", "import sys, kvfence; print('torch' in sys.modules)"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.stdout.strip() == "False", run.stderr
