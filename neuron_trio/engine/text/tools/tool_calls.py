"""Tool calls: offering tools to a model whose template cannot, and reading calls back out.

Rendering: a template that knows tools (its source mentions `tools`) gets them as
transformers passes them (`tools=[{"type": "function", "function": {...}}]`, assistant
`tool_calls` with arguments as objects, `tool` messages). For a template that does not (the
built-in SmolLM2's ChatML), neuron renders them itself, Hermes-style as Qwen 2.5's template
does: a system message listing the functions in `<tools></tools>` and asking for
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`; earlier calls become that text in
the assistant's turn, and tool results become `<tool_response>` user turns.

Gemma and Phi-3 templates know no tools: they get them Hermes-style, as the built-in model
does. Reading calls back out of the output is `tool_call_parser`'s; the markers it reads are
shown as text when the vocabulary holds them as special tokens (`tool_marker_ids`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from neuron_trio.engine.types import ToolFunction

__all__ = ["render_tools_as_text", "template_tools", "tool_marker_ids"]

log = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"

HERMES_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with "
    "the user query. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_tools(tools: Sequence[ToolFunction]) -> list[dict[str, Any]]:
    """`tools` as transformers passes them to a chat template."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": json.loads(t.parameters),
            },
        }
        for t in tools
    ]


def render_tools_as_text(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[ToolFunction]
) -> list[dict[str, Any]]:
    """Plain-text messages (roles system/user/assistant, string content) that carry `tools`
    and any tool calls and results of the history, for a template that knows no tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [
                OPEN
                + "\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                )
                + "\n"
                + CLOSE
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join([content, *calls]).strip()})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(t) for t in template_tools(tools))
        system = HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


# Markers the parser reads; a vocabulary may hold them as special tokens, which show no text.
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>")


def tool_marker_ids(tokenizer: Any) -> tuple[int, ...]:
    """The special tokens among the tool-call markers: shown as text when tools are offered,
    so that the parser sees a call's markup (and keeps it out of the content)."""
    ids = (tokenizer.token_to_id(m) for m in MARKERS)
    return tuple(i for i in ids if i is not None and i in tokenizer.special_ids)
