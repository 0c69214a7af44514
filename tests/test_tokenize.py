"""/tokenize and /detokenize in vLLM's shapes, on a real server: the ids a chat would get, and back."""

from __future__ import annotations

import httpx
import pytest

from kvfence.model.describe import describe_model
from tests.server import Server
from tests.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


ALICE = {"Authorization": "Bearer sk-alice"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tenants_file):
    with Server("--mode", "colocated", "--model", str(tiny_model_dir("llama")), "--max-context", "512",
                "--tenants", str(tenants_file)) as server:
        yield server


def post(server: Server, path: str, body: dict, headers: dict | None = ALICE) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def test_tokenize_a_prompt_and_back(server):
    text = "Hello there, general Kenobi!"
    want = describe_model(str(tiny_model_dir("llama")))[2].encode(text)
    got = post(server, "/tokenize", {"model": "llama", "prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == 512
    assert "".join(got["token_strs"]) == text
    assert post(server, "/detokenize", {"model": "llama", "tokens": want}).json() == {"prompt": text}


def test_a_chat_tokenizes_to_what_the_chat_endpoint_counts(server):
    counted = post(server, "/tokenize", {"messages": CHAT}).json()["count"]
    reply = server.client("sk-alice").chat.completions.create(model="llama", messages=CHAT, max_tokens=1)
    assert counted == reply.usage.prompt_tokens
    bare = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["count"]
    assert bare < counted


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "a", "model": "other"}, 404, "model"),
    ({"prompt": "a", "add_special_tokens": True, "truncate_prompt_tokens": 1}, 400, "truncate_prompt_tokens"),
])
def test_tokenize_errors_in_openai_shape(server, body, status, param):
    resp = post(server, "/tokenize", body)
    assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text


def test_detokenize_refuses_ids_beyond_the_vocabulary_and_both_need_a_key(server):
    resp = post(server, "/detokenize", {"tokens": [10**9]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens"
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        assert post(server, path, body, headers=None).status_code == 401
