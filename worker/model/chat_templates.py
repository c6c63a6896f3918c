"""Chat templates the service ships, chosen by `model.chat_template` in place of the tokenizer's own.

`chatml-tools`: ChatML as SmolLM2 writes it (its default system message kept), with tools declared in the
system turn and tool results as messages in the Hermes/Qwen2.5 format (worker/environments/tools.py says
the shape). Every conversation it renders is a prefix of its continuation, as multi-turn episodes need.
"""

from __future__ import annotations

# Qwen2.5's layout for tools and tool messages, on SmolLM2's ChatML turns (its default system message kept).
CHATML_TOOLS_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}"
    "{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message.get('tool_calls', []) %}"
    "{{- '\\n<tool_call>\\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']}"
    " | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = {"chatml-tools": CHATML_TOOLS_TEMPLATE}


def apply(tokenizer, name: str) -> None:
    """Give `tokenizer` the template `name` ("tokenizer": keep its own)."""
    if name != "tokenizer":
        tokenizer.chat_template = TEMPLATES[name]
