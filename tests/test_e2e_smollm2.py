"""End to end on the real SmolLM2-135M-Instruct: the official openai client against real server processes.

One colocated server and one disaggregated server (1 prefill + 1 decode over shm) serve every test here; the
disaggregated one must answer exactly like the colocated one under greedy decoding.
"""

import asyncio
import json

import openai
import pytest

from tests.server import Server

pytestmark = pytest.mark.slow


CANARY = "Repeat exactly: the secret code is ZEBRA-4471."
PROMPTS = [
    CANARY,
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Explain in one sentence what a KV cache is.",
    "Count from one to ten in words.",
    "Name a famous painting by Leonardo da Vinci.",
]
GREEDY = dict(temperature=0, max_tokens=40)


def chat(client: openai.OpenAI, prompt: str, **kw) -> str:
    reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                           **{**GREEDY, **kw})
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def colocated(tenants_file):
    with Server("--mode", "colocated", "--tenants", str(tenants_file), "--max-context", "2048") as server:
        yield server


@pytest.fixture(scope="module")
def disaggregated(tenants_file):
    with Server("--tenants", str(tenants_file), "--max-context", "2048") as server:
        yield server


@pytest.fixture(params=["colocated", "disaggregated"])
def server(request):
    return request.getfixturevalue(request.param)


def test_chat_repeats_the_canary(server):
    assert "ZEBRA-4471" in chat(server.client("sk-alice"), CANARY)


def test_streaming_gives_the_same_text(server):
    client = server.client("sk-alice")
    stream = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": CANARY}],
                                            stream=True, **GREEDY)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) > 3 and "".join(chunks) == chat(client, CANARY)


def test_over_length_prompt_is_400_context_length_exceeded(server):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(server.client("sk-bob"), "word " * 3000)
    assert exc.value.status_code == 400 and exc.value.code == "context_length_exceeded"


def test_bad_key_is_401(server):
    with pytest.raises(openai.AuthenticationError):
        chat(server.client("sk-nobody"), "hi")


def test_sixteen_concurrent_streams_match_their_sequential_answers(server):
    client = server.client("sk-alice")
    prompts = [PROMPTS[i % len(PROMPTS)] + f" (request {i})" for i in range(16)]
    sequential = [chat(client, p) for p in prompts]

    async def stream(aclient, prompt):
        out = await aclient.chat.completions.create(model="smollm2-135m", stream=True,
                                                    messages=[{"role": "user", "content": prompt}], **GREEDY)
        return "".join([c.choices[0].delta.content or "" async for c in out if c.choices])

    async def all_at_once():
        async with server.async_client("sk-alice") as aclient:
            return await asyncio.gather(*(stream(aclient, p) for p in prompts))

    assert asyncio.run(all_at_once()) == sequential


def test_disaggregated_equals_colocated_token_for_token(colocated, disaggregated):
    for prompt in PROMPTS:
        kw = dict(max_tokens=48)
        a = chat(colocated.client("sk-alice"), prompt, **kw)
        b = chat(disaggregated.client("sk-alice"), prompt, **kw)
        assert a == b, prompt


def test_one_token_prompt_chunks_agree_across_modes(colocated, disaggregated):
    """A one-token chunk takes the decode rows' kernel (int8 on AMX hosts) wherever it runs: a 1-token prompt and
    one of 513 tokens (chunks of 512 + 1) make the prefill worker compute one, lazily preparing that kernel's
    weights, and must still continue exactly as the colocated engine does."""
    ids = [(i * 37) % 5000 + 100 for i in range(513)]
    for prompt in (ids[:1], ids):
        a, b = (s.client("sk-alice").completions.create(model="smollm2-135m", prompt=prompt, max_tokens=16,
                                                         temperature=0) for s in (colocated, disaggregated))
        assert a.choices[0].text == b.choices[0].text, len(prompt)
        assert a.usage.completion_tokens == b.usage.completion_tokens > 0


def test_a_json_schema_answer_is_valid_json_of_that_shape_and_the_same_on_both_servers(colocated, disaggregated):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    answers = []
    for server in (colocated, disaggregated):
        reply = server.client("sk-alice").chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France? Answer in "
                                             "JSON with the city and its country."}],
            temperature=0, max_tokens=60, response_format=fmt)
        assert reply.choices[0].finish_reason == "stop"
        answers.append(json.loads(reply.choices[0].message.content))
    assert answers[0] == answers[1] and set(answers[0]) == {"city", "country"}
    assert "Paris" in answers[0]["city"]


def test_a_required_tool_call_names_the_tool_and_the_city(server):
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"], "additionalProperties": False}}}
    reply = server.client("sk-alice").chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "What is the weather in Paris right now?"}],
        tools=[weather], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60)
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
