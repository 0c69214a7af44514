"""Structured output (response_format) through the official openai client on real servers, tiny random-weight
Llama: whatever a random model prefers, the answer parses and matches the schema, alike colocated and
disaggregated (prefill masks the first token, decode the rest), streamed or not; a schema that cannot be
enforced is a 400 naming response_format. The real model's JSON answer is in test_e2e_smollm2.py."""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types.chat import ChatCompletion

from tests.server import Server

pytestmark = pytest.mark.slow


ASK = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
                   "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
    "required": ["name", "age", "ok", "colour", "tags"], "additionalProperties": False,
}
AS_PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def assert_person(person: object) -> None:
    assert isinstance(person, dict) and set(person) == set(PERSON["required"])
    assert isinstance(person["name"], str) and len(person["name"]) <= 8
    assert type(person["age"]) is int and 0 <= person["age"] <= 120
    assert type(person["ok"]) is bool and person["colour"] in ("red", "green", "blue")
    assert isinstance(person["tags"], list) and len(person["tags"]) <= 3 and all(type(t) is int for t in person["tags"])


def ask(server: Server, **kw) -> ChatCompletion:
    return server.client().chat.completions.create(model="llama", messages=ASK, **({"max_tokens": 120} | kw))


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_every_answer_matches_the_schema_and_ends_with_it(tiny_disaggregated, seed):
    sampling = {"temperature": 0} if seed is None else {"seed": seed}
    reply = ask(tiny_disaggregated, response_format=AS_PERSON, **sampling)
    ChatCompletion.model_validate(reply.model_dump())
    assert reply.choices[0].finish_reason == "stop"  # the grammar completed; nothing follows the object
    assert_person(json.loads(reply.choices[0].message.content))


def test_without_the_schema_the_random_model_writes_no_json(tiny_disaggregated):
    """What the mask does: the same requests unconstrained."""
    for seed in (1, 2, 3):
        with pytest.raises(ValueError):
            json.loads(ask(tiny_disaggregated, seed=seed).choices[0].message.content)


def test_colocated_disaggregated_and_streamed_answers_agree(tiny_colocated, tiny_disaggregated):
    want = ask(tiny_colocated, response_format=AS_PERSON, temperature=0).choices[0].message.content
    assert ask(tiny_disaggregated, response_format=AS_PERSON, temperature=0).choices[0].message.content == want
    stream = tiny_disaggregated.client().chat.completions.create(
        model="llama", messages=ASK, max_tokens=120, stream=True, temperature=0, response_format=AS_PERSON)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_json_object_gives_an_object(tiny_colocated):
    """A random model rambles inside strings; a bias towards the quote and the closing brace (still masked by
    the grammar) lets it finish, and what it finishes is an object."""
    ids = {t: httpx.post(tiny_colocated.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in ('"', "}")}
    assert all(len(v) == 1 for v in ids.values())
    bias = {str(v[0]): 20 for v in ids.values()}
    for seed in (1, 2):
        reply = ask(tiny_colocated, response_format={"type": "json_object"}, seed=seed, logit_bias=bias)
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "cannot be enforced"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}, "cannot be enforced"),
    ({"type": "json_schema"}, "required"),
    ({"type": "yaml"}, "Invalid value"),
    ({"type": "json_object", "extra": 1}, "Unrecognized"),
])
def test_a_schema_that_cannot_be_enforced_is_a_400(tiny_disaggregated, fmt, words):
    resp = httpx.post(tiny_disaggregated.url + "/v1/chat/completions", timeout=30,
                      json={"messages": ASK, "response_format": fmt})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"].startswith("response_format") and words in err["message"], err
