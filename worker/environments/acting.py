"""How a model turn reaches the environment, and what the model reads back.

- No tools (`environment.tools` unset): the turn's text is the action (`{action_field: text}`); the
  observation comes back as the next user message.
- MCP tools (`tools: mcp`): the turn's `<tool_call>` blocks are made as MCP `tools/call`s in the episode's
  session, in order; each result (or the tool's error) comes back as a `tool` message. A block that cannot
  be read (not JSON, no such tool, unclosed) is answered with a tool message saying what is wrong, and
  counted. A turn without a call is the model's answer: sent as a text action, as above.
- Declared tools (a list, for a server that reads calls from text): the turn's text is the action either
  way; the answer to a turn with calls comes back as a `tool` message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from worker.environments.client import Session, StepResult
from worker.environments.limits import Limits
from worker.environments.tools import Tool, parse_with_tokenizer
from worker.environments.turns import Reply


def observation_text(result: StepResult, field: str) -> str:
    """The observation's text for the model: its `field` (any JSON value shown as text)."""
    value = result.observation.get(field, "")
    return value if isinstance(value, str) else str(value)


def cut_observation(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    """`text` cut to its first `max_tokens` tokens (a hostile server's 1 MB line, say); whether it was cut."""
    if len(text) <= max_tokens:  # no tokenizer makes more tokens than characters here
        return text, False
    ids = tokenizer.encode(text[: max_tokens * 32], add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=True), True


@dataclass(frozen=True)
class ToolUse:
    """How a job's turns reach its environment."""

    tools: tuple[Tool, ...] = ()  # declared to the model; none: the turn's text is the action
    mcp: bool = False  # calls are made as the server's MCP tools; else the server reads them from the text


@dataclass(frozen=True)
class Outcome:
    """The environment's answer to one model turn."""

    replies: tuple[Reply, ...]  # what the model reads next, in order
    reward: float | None
    done: bool
    tool_calls: int = 0  # calls made (or, for a text server, that it said it made)
    tool_errors: int = 0  # ... that failed
    malformed: int = 0  # `<tool_call>` blocks that could not be read
    cut: int = 0  # replies cut to max_observation_tokens

    @property
    def text(self) -> str:
        """The answer as text, for the episode's record."""
        return "\n".join(r.content for r in self.replies)


def _observed(tokenizer, r: StepResult, limits: Limits, *, as_tool: bool = False, calls: int = 0,
              malformed: int = 0) -> Outcome:
    """An observation as the model's next message (a tool message `as_tool`), cut to max_observation_tokens."""
    text, cut = cut_observation(tokenizer, observation_text(r, limits.observation_field), limits.max_observation_tokens)
    said_call, said_error = bool(r.observation.get("tool_call")), bool(r.observation.get("tool_error"))
    return Outcome(replies=(Reply(text, "tool" if as_tool else "user"),), reward=r.reward, done=r.done,
                   tool_calls=max(calls, int(said_call)), tool_errors=int(said_error), malformed=malformed,
                   cut=int(cut))


async def act(tokenizer, session: Session, text: str, use: ToolUse, limits: Limits,
              prompt: Callable[[], str] = str) -> Outcome:
    """The environment's answer to the turn `text` (EnvironmentFailed where the session fails); `prompt()`:
    the text the turn continued, for a tokenizer's own response parser."""
    if not use.tools:
        return _observed(tokenizer, await session.step({limits.action_field: text}), limits)
    parsed = parse_with_tokenizer(tokenizer, text, prompt, use.tools)
    if not parsed.any:  # the model's answer
        return _observed(tokenizer, await session.step({limits.action_field: text}), limits)
    if not use.mcp:  # the server reads the calls from the text
        r = await session.step({limits.action_field: text})
        return _observed(tokenizer, r, limits, as_tool=True, calls=len(parsed.calls), malformed=len(parsed.malformed))
    replies: list[Reply] = []
    errors = cut = 0
    for call in parsed.calls:
        result = await session.call_tool(call.name, dict(call.arguments))
        content, was_cut = cut_observation(tokenizer, result.text, limits.max_observation_tokens)
        replies.append(Reply(content, "tool"))
        errors, cut = errors + result.error, cut + was_cut
    replies.extend(Reply(f"error: {what}", "tool") for what in parsed.malformed)
    return Outcome(replies=tuple(replies), reward=None, done=False, tool_calls=len(parsed.calls), tool_errors=errors,
                   malformed=len(parsed.malformed), cut=cut)


def declared(tools: Sequence[Tool]) -> tuple[dict, ...]:
    """The chat template's `tools=` argument."""
    return tuple(t.schema() for t in tools)
