"""Tool calling: tools into the prompt, calls out of the text, and a grammar where a call is required.

The model writes each call as a ``<tool_call>`` block holding ``{"name": ..., "arguments": {...}}`` (the Hermes
format, which many chat templates define). ``ToolUse`` does three things:

- **prompt**: a template that knows tools (its source names ``tools``) gets them, and the history's
  ``tool_calls`` as dicts; any other template gets a system message describing the tools and the format, and
  the history's calls and tool results written as blocks, so a model without tool support still sees them;
- **grammar**: ``tool_choice`` ``required`` or a named function makes the output exactly such blocks whose
  JSON matches one of the allowed functions' ``parameters`` (llguidance, ``engine/grammar.py``), so it works
  for models without a tool parser;
- **parsing**: ``parse`` (whole text) and ``CallStream`` (sans-IO, for streams) split the text into content and
  calls. A block whose JSON does not parse, or names no offered function, stays content.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher

from kvfence.core import InvalidRequest
from kvfence.engine.grammar import JSON_LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_dict(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


@dataclass(frozen=True)
class ToolUse:
    """The request's ``tools`` (OpenAI's dicts, validated by the schema), ``tool_choice`` and
    ``parallel_tool_calls``."""

    tools: list[dict[str, Any]]
    choice: str | dict[str, Any] = "auto"
    parallel: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.choice, dict) and self.choice["function"]["name"] not in self.names:
            raise InvalidRequest(f"tool_choice names function {self.choice['function']['name']!r}, which is not "
                                 "among the tools.", param="tool_choice")
        if self.choice == "required" and not self.tools:
            raise InvalidRequest("tool_choice 'required' needs at least one tool.", param="tool_choice")

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls (every choice but ``none``)."""
        return bool(self.tools) and self.choice != "none"

    # -- prompt --------------------------------------------------------------------------------------------

    def template_kwargs(self, template: str | None) -> dict[str, Any]:
        """What the chat template gets besides the messages: ``tools`` when it knows them."""
        return {"tools": self.tools} if self.tools and knows_tools(template) else {}

    def system_note(self, template: str | None) -> str | None:
        """For a template that does not know tools: the text that tells the model about them."""
        if not self.tools or knows_tools(template):
            return None
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools)
        return ("You can call functions. Their signatures, one JSON object per line:\n<tools>\n" + listed +
                "\n</tools>\nTo call one, answer with a JSON object naming it and giving its arguments, inside "
                f"{OPEN}{CLOSE} tags:\n{OPEN}\n" + '{"name": "function_name", "arguments": {"arg": "value"}}' +
                f"\n{CLOSE}")

    # -- grammar -------------------------------------------------------------------------------------------

    def grammar(self) -> str | None:
        """The llguidance grammar that ``required`` or a named ``tool_choice`` imposes; None for auto and none."""
        if self.choice in ("auto", "none"):
            return None
        allowed = [t for t in self.tools if not isinstance(self.choice, dict)
                   or t["function"]["name"] == self.choice["function"]["name"]]
        schema = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            "arguments": t["function"].get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for t in allowed],
            "x-guidance": JSON_LAYOUT}
        calls = 'call ("\\n" call)*' if self.parallel and not isinstance(self.choice, dict) else "call"
        return LLMatcher.grammar_from_lark(
            f"start: {calls}\ncall: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")

    # -- parsing -------------------------------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``text`` as (content, calls): content is what lies outside the call blocks (None when only blanks)."""
        stream = CallStream(self)
        events = stream.feed(text) + stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        return (content if content.strip() else None), [e for e in events if isinstance(e, ToolCall)]

    def call_of(self, block: str) -> ToolCall | None:
        """A block's call, if its JSON names an offered function and gives arguments as an object."""
        try:
            data = json.loads(block)
        except ValueError:
            return None
        if not (isinstance(data, dict) and data.get("name") in self.names and isinstance(data.get("arguments"),
                                                                                         dict)):
            return None
        return ToolCall(data["name"], json.dumps(data["arguments"], ensure_ascii=False))


def knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


class CallStream:
    """Splits streamed text into content and calls: ``feed`` and ``finish`` return events, each a content string
    or a ``ToolCall``. Text that may begin a block is held back until it is clearly not one."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.buffer = ""
        self.inside = False  # after an OPEN tag, collecting the block

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buffer += text
        events: list[str | ToolCall] = []
        while True:
            if self.inside:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return events
                events.append(self._block(self.buffer[:end], closed=True))
                self.buffer, self.inside = self.buffer[end + len(CLOSE):], False
                continue
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_tag(self.buffer)
                if len(self.buffer) > keep:
                    events.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                return events
            if start:
                events.append(self.buffer[:start])
            self.buffer, self.inside = self.buffer[start + len(OPEN):], True

    def finish(self) -> list[str | ToolCall]:
        """The rest: an unterminated block is still a call if its JSON is whole (a model may stop right after it)."""
        rest, inside = self.buffer, self.inside
        self.buffer, self.inside = "", False
        if not rest:
            return []
        return [self._block(rest, closed=False)] if inside else [rest]

    def _block(self, body: str, closed: bool) -> str | ToolCall:
        call = self.use.call_of(body.strip())
        return call if call is not None else OPEN + body + (CLOSE if closed else "")


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0
