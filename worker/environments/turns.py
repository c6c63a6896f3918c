"""How an episode's turns become tokens, without ever re-rendering the conversation.

An episode's ids grow by appending: the first prompt (the chat template applied to the reset's
observation), then per turn the ids the model sampled, then the tokens that close the model's turn
and open the next one around the observation, tokenized on their own. Earlier ids are never
decoded and encoded again, so the ids the model is trained on are the ids it sampled (a re-rendered
conversation tokenizes differently at turn boundaries, and the log-prob mismatch that creates
collapses training even on-policy).

That is only sound when the template renders every conversation as a prefix of its continuation;
a template that rewrites earlier turns (one that drops earlier reasoning, say) is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# Probe texts: nothing a template would special-case, and distinct from each other.
_USER, _MODEL, _NEXT = "PROBE-USER-7f3a", "PROBE-MODEL-2c9e", "PROBE-NEXT-b41d"
_PROBE = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MODEL}]


class TemplateRefused(ValueError):
    """The tokenizer's chat template cannot be extended turn by turn."""


@dataclass(frozen=True)
class Reply:
    """What the model reads after its turn: the environment's observation, or a tool's result."""

    content: str
    role: Literal["user", "tool"] = "user"


class TurnFormat(Protocol):
    def first(self, observation: str) -> list[int]:
        """The ids of the first prompt: the reset's observation, ready for the model's first turn."""

    def between(self, replies: Sequence[Reply], *, ended_with_eos: bool) -> list[int]:
        """The ids appended after a model turn: what closes it (less the EOS the model sampled) and the
        replies as the next messages (an observation as a user turn, tool results as tool messages), ready
        for the model's next turn."""


def _render(tokenizer, messages: list[dict[str, str]], *, prompt: bool, tools: Sequence[dict[str, Any]] = ()) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                         tools=list(tools) or None)


def _messages(replies: Sequence[Reply]) -> list[dict[str, str]]:
    return [{"role": r.role, "content": r.content} for r in replies]


@dataclass(frozen=True)
class ChatTurns:
    """Turns in the tokenizer's chat template: the observation is the user's message, a tool's result a
    tool message; `tools` (chat-template schemas) are declared in the first prompt."""

    tokenizer: object
    close: str  # what the template writes after a model turn's text ("<|im_end|>\n")
    eos_text: str  # the EOS token's text: a turn that sampled it has written that much of `close`
    answered: str  # the probe conversation through the model's turn: what `between` renders on from
    tools: tuple[dict[str, Any], ...] = field(default=())

    @staticmethod
    def of(tokenizer, tools: Sequence[dict[str, Any]] = ()) -> ChatTurns:
        """The format of `tokenizer`'s template, checked to keep every turn a prefix of the next
        conversation (a tool message's too, with tools); TemplateRefused when it does not."""
        asked = _render(tokenizer, _PROBE[:1], prompt=True, tools=tools)
        answered = _render(tokenizer, _PROBE, prompt=False, tools=tools)
        nexts = [[Reply(_NEXT)]] + ([[Reply(_NEXT, "tool")], [Reply(_NEXT, "tool"), Reply(_USER, "tool")]]
                                    if tools else [])
        for replies in nexts:
            following = _render(tokenizer, _PROBE + _messages(replies), prompt=True, tools=tools)
            later = _render(tokenizer, _PROBE + _messages(replies) + _PROBE[::-1], prompt=True, tools=tools)
            if not following.startswith(answered) or not later.startswith(following):
                raise TemplateRefused(f"the chat template rewrites earlier turns when a {replies[0].role} message is "
                                      "added, so an episode cannot be extended turn by turn without re-tokenizing "
                                      "what the model sampled")
        if not answered.startswith(asked) or not answered[len(asked):].startswith(_MODEL):
            raise TemplateRefused("the chat template does not render the model's turn right after its generation "
                                  "prompt, so the sampled ids would not be the conversation's")
        eos = tokenizer.eos_token or ""
        close = answered[len(asked) + len(_MODEL):]
        return ChatTurns(tokenizer=tokenizer, close=close, eos_text=eos if close.startswith(eos) else "",
                         answered=answered, tools=tuple(tools))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def first(self, observation: str) -> list[int]:
        return self._encode(_render(self.tokenizer, [{"role": "user", "content": observation}], prompt=True,
                                    tools=self.tools))

    def between(self, replies: Sequence[Reply], *, ended_with_eos: bool) -> list[int]:
        close = self.close[len(self.eos_text):] if ended_with_eos else self.close
        # the next messages and generation prompt, as the template writes them after a closed model turn
        following = _render(self.tokenizer, _PROBE + _messages(replies), prompt=True, tools=self.tools)
        return self._encode(close + following[len(self.answered):])


@dataclass(frozen=True)
class PlainTurns:
    """Turns for a tokenizer with no chat template: each observation on its own lines."""

    tokenizer: object

    def first(self, observation: str) -> list[int]:
        return self.tokenizer.encode(observation + "\n", add_special_tokens=False)

    def between(self, replies: Sequence[Reply], *, ended_with_eos: bool) -> list[int]:
        text = "".join(f"\n<tool_response>\n{r.content}\n</tool_response>" if r.role == "tool" else f"\n{r.content}"
                       for r in replies)
        return self.tokenizer.encode(text + "\n", add_special_tokens=False)


def turn_format(tokenizer, *, chat: bool, tools: Sequence[dict[str, Any]] = ()) -> TurnFormat:
    """The chat template's turns where the tokenizer has one and the job uses it, else plain lines."""
    if chat and getattr(tokenizer, "chat_template", None):
        return ChatTurns.of(tokenizer, tools)
    return PlainTurns(tokenizer)
