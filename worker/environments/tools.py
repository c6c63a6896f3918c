"""Tools as models call them: declared in the prompt by the chat template, called as `<tool_call>` blocks.

The shape is Hermes's and Qwen2.5's, which TRL, verifiers and most tool-calling models share: the template
renders each tool's JSON schema (`{"type": "function", "function": {"name", "description", "parameters"}}`)
inside `<tools></tools>` in the system turn; the model calls one with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (several in a turn, in order); each result comes
back as a `tool` message, which the template wraps in `<tool_response></tool_response>`.

A tokenizer whose template has no tools branch (SmolLM2's ChatML) can be given `chatml-tools`
(`model.chat_template`, worker/model/chat_templates.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
MAX_CALLS = 8  # tool calls one turn may make; more are answered with an error, not made


@dataclass(frozen=True)
class Tool:
    """A tool the model may call, as the chat template renders it."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # its arguments' JSON schema

    def schema(self) -> dict[str, Any]:
        """The chat template's `tools=` entry."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}

    @staticmethod
    def of_mcp(tool: Mapping[str, Any]) -> Tool:
        """An MCP `tools/list` entry (`inputSchema`, or `input_schema` as OpenEnv serialises it)."""
        schema = tool.get("inputSchema", tool.get("input_schema")) or {"type": "object", "properties": {}}
        return Tool(name=str(tool["name"]), description=str(tool.get("description") or ""), parameters=schema)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class CallsInTurn:
    """A turn's tool calls in order, and the calls that could not be read (each as what was wrong)."""

    calls: tuple[ToolCall, ...]
    malformed: tuple[str, ...]

    @property
    def any(self) -> bool:
        return bool(self.calls or self.malformed)


def _one_call(body: str, known: set[str]) -> ToolCall | str:
    """A `<tool_call>` block's JSON as a call, or what is wrong with it."""
    try:
        obj = json.loads(body)
    except ValueError:
        return f"not JSON: {body.strip()[:80]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'not an object with a "name"'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return f"{obj['name']}: arguments are not JSON"
    if not isinstance(args, dict):
        return f"{obj['name']}: arguments are not an object"
    if known and obj["name"] not in known:
        return f"no tool is named {obj['name'][:40]!r} (there are: {', '.join(sorted(known))})"
    return ToolCall(name=obj["name"], arguments=args)


def parse_calls(text: str, tools: Sequence[Tool]) -> CallsInTurn:
    """The `<tool_call>` blocks of a turn's text; an unclosed block (the turn ran out of tokens) is malformed."""
    known = {t.name for t in tools}
    calls: list[ToolCall] = []
    malformed: list[str] = []
    for m in _CALL.finditer(text):
        parsed = _one_call(m.group(1), known)
        (calls if isinstance(parsed, ToolCall) else malformed).append(parsed)  # type: ignore[arg-type]
    tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if "</tool_call>" in text else text
    if "<tool_call>" in tail:
        malformed.append("a <tool_call> block was not closed")
    if len(calls) > MAX_CALLS:
        malformed.extend(f"{c.name}: more than {MAX_CALLS} calls in one turn" for c in calls[MAX_CALLS:])
        calls = calls[:MAX_CALLS]
    return CallsInTurn(calls=tuple(calls), malformed=tuple(malformed))


def parse_with_tokenizer(tokenizer, text: str, prefix: Callable[[], str], tools: Sequence[Tool]) -> CallsInTurn:
    """The turn's calls by the tokenizer's own response parser where it has one (`response_template`; it
    reads `prefix()`, the prompt's end), else parse_calls."""
    if getattr(tokenizer, "response_template", None) is None:
        return parse_calls(text, tools)
    try:
        message = tokenizer.parse_response(text, prefix=prefix(), tools=[t.schema() for t in tools])
    except Exception as exc:  # noqa: BLE001  (a parser's own error is the model's malformed call)
        return CallsInTurn(calls=(), malformed=(f"the tokenizer's parser refused it: {str(exc)[:120]}",))
    calls, malformed = [], []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        parsed = _one_call(json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})}),
                           {t.name for t in tools})
        (calls if isinstance(parsed, ToolCall) else malformed).append(parsed)
    return CallsInTurn(calls=tuple(calls), malformed=tuple(malformed))


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools=` argument at all."""
    probe = [{"role": "user", "content": "PROBE"}]
    tool = Tool("probe_tool_5e1c", "probe", {"type": "object", "properties": {}}).schema()
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001  (a template that fails on tools has no tools branch)
        return False
    return "probe_tool_5e1c" in with_tools
