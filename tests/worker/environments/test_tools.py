"""Tools as models call them: the bundled ChatML tools template keeps every turn a prefix of the next,
`<tool_call>` blocks parse (valid, malformed, several, unclosed), and a template that cannot show tools
or rewrites a turn when a tool message is added is refused."""

import json

import pytest

from worker.environments.tools import MAX_CALLS, Tool, ToolCall, parse_calls, renders_tools
from worker.environments.turns import ChatTurns, Reply, TemplateRefused
from worker.model.chat_templates import CHATML_TOOLS_TEMPLATE
from worker.model.loading import char_tokenizer

CALC = Tool("calculator", "Evaluate an arithmetic expression.",
            {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
# ChatML whose tool messages drop the earlier tool results (a template that rewrites what came before)
FORGETS_TOOLS = CHATML_TOOLS_TEMPLATE.replace("message['content'] + '\\n</tool_response>'",
                                              "(message['content'] if loop.last else '') + '\\n</tool_response>'")


def _tok(template=CHATML_TOOLS_TEMPLATE):
    tok = char_tokenizer()  # one id per character: pieces tokenize exactly as the whole
    tok.chat_template = template
    return tok


def test_tool_turns_appended_are_the_whole_conversation_rendered():
    tok = _tok()
    turns = ChatTurns.of(tok, [CALC.schema()])
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3998*618"}}\n</tool_call>'
    ids = (turns.first("What is 3998 * 618?") + tok.encode(call, add_special_tokens=False)
           + turns.between([Reply("2470764", "tool"), Reply("error: no tool is named 'x'", "tool")], ended_with_eos=False)
           + tok.encode("<answer>2470764</answer>", add_special_tokens=False)
           + turns.between([Reply("Correct.")], ended_with_eos=False))
    whole = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3998 * 618?"}, {"role": "assistant", "content": call},
         {"role": "tool", "content": "2470764"}, {"role": "tool", "content": "error: no tool is named 'x'"},
         {"role": "assistant", "content": "<answer>2470764</answer>"}, {"role": "user", "content": "Correct."}],
        tools=[CALC.schema()], tokenize=False, add_generation_prompt=True)
    assert ids == tok.encode(whole, add_special_tokens=False)
    text = tok.decode(turns.first("Q"))
    assert "<tools>\n" + json.dumps(CALC.schema()) + "\n</tools>" in text  # the schema, as the model reads it
    assert "<|im_start|>user\n<tool_response>\n2470764\n</tool_response>\n<tool_response>" in tok.decode(ids)


def test_a_template_without_tools_or_that_rewrites_tool_turns_is_refused():
    plain_chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert renders_tools(_tok()) and not renders_tools(_tok(plain_chatml))
    with pytest.raises(TemplateRefused, match="rewrites earlier turns when a tool message is added"):
        ChatTurns.of(_tok(FORGETS_TOOLS), [CALC.schema()])
    ChatTurns.of(_tok(FORGETS_TOOLS))  # without tools no tool message is rendered: it extends turn by turn


@pytest.mark.parametrize(("text", "calls", "malformed"), [
    ("The answer is 5.", [], []),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>',
     [ToolCall("calculator", {"expression": "1+2"})], []),
    ('a <tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}\n</tool_call> b '
     '<tool_call>{"name": "calculator", "arguments": {"expression": "4"}}</tool_call>',
     [ToolCall("calculator", {"expression": "2*3"}), ToolCall("calculator", {"expression": "4"})], []),
    ("<tool_call>{calculator: 1+2}</tool_call>", [], ["not JSON: '{calculator: 1+2}'"]),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', [],
     ["no tool is named 'search' (there are: calculator)"]),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', [], ["calculator: arguments are not an object"]),
    ('<tool_call>["calculator"]</tool_call>', [], ['not an object with a "name"']),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call><tool_call>{"name": "calc',
     [ToolCall("calculator", {"expression": "1"})], ["a <tool_call> block was not closed"]),
])
def test_tool_calls_parse_as_written(text, calls, malformed):
    parsed = parse_calls(text, [CALC])
    assert (list(parsed.calls), list(parsed.malformed)) == (calls, malformed)


def test_a_turn_makes_at_most_max_calls():
    one = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    parsed = parse_calls(one * (MAX_CALLS + 2), [CALC])
    assert len(parsed.calls) == MAX_CALLS and len(parsed.malformed) == 2


def test_an_mcp_tool_listing_becomes_the_templates_schema():
    listed = {"name": "calculator", "description": "Evaluate.", "input_schema": CALC.parameters, "title": "Calc"}
    assert Tool.of_mcp(listed).schema() == Tool("calculator", "Evaluate.", CALC.parameters).schema()
    assert Tool.of_mcp({"name": "t", "inputSchema": {"type": "object"}}).parameters == {"type": "object"}
