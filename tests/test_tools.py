"""Tool calling: the sans-IO parts (parsing whole and streamed text, the grammar a required call imposes, the
prompt a template gets) and real servers (tiny random-weight Llama) answering required and named calls through
the official openai client, alike colocated and disaggregated, streamed or not. SmolLM2's calls are in
test_e2e_smollm2.py."""

from __future__ import annotations

import json

import httpx
import pytest
from llguidance import LLMatcher
from openai.types.chat import ChatCompletion

from kvfence.core import InvalidRequest
from kvfence.engine.grammar import ll_tokenizer
from kvfence.model.tokenizer import Tokenizer
from kvfence.router.schemas import ChatMessage
from kvfence.router.tools import CallStream, ToolCall, ToolUse
from tests.server import Server
from tests.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def block(name: str, arguments: dict | str) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


MIXED = ("Let me check. " + block("get_weather", {"city": "Paris", "unit": "c"}) + "\n" + block("add", {"a": 1, "b": 2})
         + " and " + block("nope", {}) + block("add", "{not json") + " done")


def plain(events: list) -> tuple[str, list[tuple[str, str]]]:
    return ("".join(e for e in events if isinstance(e, str)),
            [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)])


def test_parse_splits_content_and_calls_and_keeps_what_is_no_call():
    content, calls = ToolUse(TOOLS).parse(MIXED)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"}),
                                                                  ("add", {"a": 1, "b": 2})]
    assert content == ("Let me check. \n and " + block("nope", {}) + block("add", "{not json") + " done")
    assert ToolUse(TOOLS).parse(block("add", {"a": 1, "b": 2}))[0] is None  # only a call: no content
    # a model may stop right after the JSON, without the closing tag
    assert ToolUse(TOOLS).parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')[1][0].name == "add"
    assert ToolUse(TOOLS).parse("<tool_call>\n{half")[0] == "<tool_call>\n{half"
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_text_gives_the_same_content_and_calls_however_it_is_cut(piece):
    use = ToolUse(TOOLS)
    stream = CallStream(use)
    events = [e for i in range(0, len(MIXED), piece) for e in stream.feed(MIXED[i : i + piece])] + stream.finish()
    whole = CallStream(use)
    assert plain(events) == plain(whole.feed(MIXED) + whole.finish())
    content, calls = use.parse(MIXED)
    assert plain(events) == (content, [(c.name, c.arguments) for c in calls])
    # text that only looks like the start of a tag is held back, then released
    held = CallStream(use)
    assert held.feed("a <tool") == ["a "] and held.feed("box>") == ["<toolbox>"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_model_dir("llama"))


def accepts(grammar: str, text: str, tokenizer: Tokenizer) -> bool:
    matcher = LLMatcher(ll_tokenizer(tokenizer, tokenizer.vocab_size), grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


def test_a_required_or_named_call_is_a_grammar_of_call_blocks_matching_the_parameters(tokenizer):
    weather = block("get_weather", {"city": "Paris", "unit": "c"})
    required = ToolUse(TOOLS, "required").grammar()
    assert accepts(required, weather, tokenizer) and accepts(required, weather + "\n" + weather, tokenizer)
    assert not accepts(required, "It is sunny.", tokenizer)
    assert not accepts(required, block("get_weather", {"city": "Paris", "unit": "kelvin"}), tokenizer)
    assert not accepts(required, block("get_weather", {"city": "Paris"}), tokenizer)
    named = ToolUse(TOOLS, {"type": "function", "function": {"name": "add"}}).grammar()
    assert accepts(named, block("add", {"a": 1, "b": 2}), tokenizer) and not accepts(named, weather, tokenizer)
    single = ToolUse(TOOLS, "required", parallel=False).grammar()
    assert accepts(single, weather, tokenizer) and not accepts(single, weather + "\n" + weather, tokenizer)
    assert ToolUse(TOOLS, "auto").grammar() is None and ToolUse(TOOLS, "none").grammar() is None


def test_a_template_without_tools_gets_them_described_and_the_history_as_blocks():
    history = [ChatMessage.model_validate(m) for m in [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]]
    bare = "{% for m in messages %}{{ m.content }}{% endfor %}"
    use = ToolUse(TOOLS)
    assert use.template_kwargs(bare) == {} and "get_weather" in use.system_note(bare)
    call, result = (m.for_template(knows_tools=False) for m in history)
    assert call["content"] == block("add", {"a": 1, "b": 2}) and "tool_calls" not in call
    assert result["content"] == "<tool_response>\n3\n</tool_response>"
    aware = "{% for t in tools %}{{ t.function.name }}{% endfor %}"
    assert use.template_kwargs(aware) == {"tools": TOOLS} and use.system_note(aware) is None
    call, result = (m.for_template(knows_tools=True) for m in history)
    assert call["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert result == {"role": "tool", "content": "3", "tool_call_id": "call_1"}


def test_a_named_choice_must_name_an_offered_tool():
    with pytest.raises(InvalidRequest, match="not among the tools"):
        ToolUse(TOOLS, {"type": "function", "function": {"name": "rm_rf"}})


# ---------------------------------------------------------------------------------------------- real servers



def call(server: Server, choice, **kw) -> ChatCompletion:
    return server.client().chat.completions.create(model="llama", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                   max_tokens=150, **({"temperature": 0} | kw))


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_a_required_call_is_made_even_by_a_random_model(tiny_disaggregated, seed):
    reply = call(tiny_disaggregated, "required", **({} if seed is None else {"temperature": 1.0, "seed": seed}))
    ChatCompletion.model_validate(reply.model_dump())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for c in choice.message.tool_calls:
        args = json.loads(c.function.arguments)
        if c.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 12
        else:
            assert c.function.name == "add" and set(args) == {"a", "b"} and all(type(v) is int for v in args.values())


def test_named_calls_agree_colocated_disaggregated_and_streamed(tiny_colocated, tiny_disaggregated):
    add = {"type": "function", "function": {"name": "add"}}
    want = call(tiny_colocated, add).choices[0].message.tool_calls
    assert [t.function.name for t in want] == ["add"]
    got = call(tiny_disaggregated, add).choices[0].message.tool_calls
    assert [t.function.arguments for t in got] == [t.function.arguments for t in want]
    chunks = list(call(tiny_disaggregated, add, stream=True))
    deltas = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
    streamed = [(d.index, d.function.name, d.function.arguments) for d in deltas]
    assert streamed == [(0, "add", want[0].function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_history_with_calls_and_results_is_answered(tiny_disaggregated):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "21 degrees, sunny"}]
    client = tiny_disaggregated.client()
    with_tools = client.chat.completions.create(model="llama", messages=history, tools=TOOLS, max_tokens=4)
    without = client.chat.completions.create(model="llama", messages=history, max_tokens=4)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens > 0  # the tools were described


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.[0].type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests_are_400s_naming_the_param(tiny_disaggregated, body, param):
    resp = httpx.post(tiny_disaggregated.url + "/v1/chat/completions", json={"messages": ASK} | body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()
