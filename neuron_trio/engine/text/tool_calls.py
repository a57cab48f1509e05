"""Tool calls: offering tools to a model whose template cannot, and reading calls back out.

Rendering: a template that knows tools (its source mentions `tools`) gets them as
transformers passes them (`tools=[{"type": "function", "function": {...}}]`, assistant
`tool_calls` with arguments as objects, `tool` messages). For a template that does not (the
built-in SmolLM2's ChatML), neuron renders them itself, Hermes-style as Qwen 2.5's template
does: a system message listing the functions in `<tools></tools>` and asking for
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`; earlier calls become that text in
the assistant's turn, and tool results become `<tool_response>` user turns.

Parsing (`ToolCallParser`): Hermes-style `<tool_call>` blocks anywhere in the output (the text
around them stays content), Mistral's `[TOOL_CALLS]` followed by a JSON list of calls, or
Llama 3.x's format, an answer that is one JSON object with "name" and "parameters" (or
"arguments"), possibly after `<|python_tag|>`. Gemma and Phi-3 templates know no tools: they
get them Hermes-style, as the built-in model does. Markup never reaches the content.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from neuron_trio.engine.text.tool_call_format import ToolCallFormat
from neuron_trio.engine.types import ToolCall, ToolFunction

__all__ = ["ToolCallParser", "render_tools_as_text", "template_tools", "tool_marker_ids"]

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
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


def tool_marker_ids(tokenizer: Any) -> tuple[int, ...]:
    """The special tokens among the tool-call markers: shown as text when tools are offered,
    so that the parser sees a call's markup (and keeps it out of the content)."""
    ids = (tokenizer.token_to_id(m) for m in MARKERS)
    return tuple(i for i in ids if i is not None and i in tokenizer.special_ids)


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Separates one sequence's output into content text and tool calls, as it streams.

    `push(text)` returns the content that is safe to show and the calls completed so far; text
    that may be the start of a call is held back until it is known. Tool-call markup never
    reaches the content: a block that turns out not to be a call (an unknown function, not
    JSON), a call cut off by the end of the output, and with `cut` (max_tokens) the start of
    a marker that might have become one, are dropped (and logged).

    `watcher` (set by the engine for `tool_choice: "auto"`) sees the same output token by
    token, to hold a call to the tools' schemas once it begins (`tool_call_start`).
    """

    def __init__(
        self, fmt: ToolCallFormat, tools: Sequence[ToolFunction], *, parallel: bool = True
    ) -> None:
        self.format = fmt
        self.names = {t.name for t in tools}
        self.parallel = parallel  # False: a call after the first is dropped
        self.calls: list[ToolCall] = []
        self.watcher: Any = None  # a tool_call_start.CallStartWatcher in auto mode
        self._open = fmt.marker or OPEN
        self._pending = ""  # held back: maybe (part of) a call
        self._started = False  # llama3: content seen (a call must come first)

    def push(self, text: str, *, final: bool, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """Feed the next text; `final` when the output has ended, `cut` when it ended at
        max_tokens rather than where the model chose to stop."""
        self._pending += text
        if self.format.style == "llama3":
            return self._push_llama3(final)
        return self._push_marked(final, cut)

    def _push_marked(self, final: bool, cut: bool) -> tuple[str, list[ToolCall]]:
        """Hermes `<tool_call>{...}</tool_call>` blocks, or Mistral's `[TOOL_CALLS][{...}]`."""
        content: list[str] = []
        new: list[ToolCall] = []
        while True:
            start = self._pending.find(self._open)
            if start < 0:
                break
            found = self._block(self._pending[start + len(self._open) :])
            if found is None:
                break  # not complete yet
            bodies, used = found
            content.append(self._pending[:start])
            for body in bodies:
                call = self._call(body, "arguments")
                if call is not None and not self.parallel and (self.calls or new):
                    call = None
                if call is None:
                    log.info("dropped tool-call markup that is not a call: %.200s", body)
                else:
                    new.append(call)
            self._pending = self._pending[start + len(self._open) + used :]
        start = self._pending.find(self._open)
        if final:
            if start >= 0:
                log.info("dropped an unfinished tool call: %.200s", self._pending[start:])
                content.append(self._pending[:start])
            else:
                keep = _partial_suffix(self._pending, self._open) if cut else len(self._pending)
                content.append(self._pending[:keep])
            self._pending = ""
        else:
            keep = start if start >= 0 else _partial_suffix(self._pending, self._open)
            content.append(self._pending[:keep])
            self._pending = self._pending[keep:]
        self.calls.extend(new)
        return "".join(content), new

    def _block(self, after: str) -> tuple[list[Any], int] | None:
        """The calls' JSON after a marker and how many characters they take, or None while the
        block is incomplete."""
        if self.format.style == "mistral":
            body = after.lstrip()
            if not body:
                return None
            try:
                value, end = _DECODER.raw_decode(body)
            except json.JSONDecodeError:
                if body[0] not in "[{":
                    return [body], len(after)  # not a list of calls: dropped as a whole
                return None  # maybe not complete yet
            values = value if isinstance(value, list) else [value]
            return values, len(after) - len(body) + end
        end = _close_of(after)
        if end < 0:
            return None
        return [after[:end]], end + len(CLOSE)

    def _push_llama3(self, final: bool) -> tuple[str, list[ToolCall]]:
        if not self._started:
            stripped = self._pending.lstrip().removeprefix("<|python_tag|>").lstrip()
            if stripped and not stripped.startswith("{"):
                self._started = True  # plain content: stream it (without the tag, markup)
                self._pending = self._pending.replace("<|python_tag|>", "", 1)
            elif not final:
                return "", []
            else:
                # the answer began as a call ("{"): it is one, or it is dropped (never shown
                # as content: with tools offered, a Llama 3.x answer that is JSON is a call)
                call = self._call(stripped, "parameters") if stripped else None
                self._pending = ""
                if call is not None:
                    self.calls.append(call)
                    return "", [call]
                if stripped:
                    log.info("dropped a tool call that does not parse: %.200s", stripped)
                return "", []
        text, self._pending = self._pending, ""
        return text, []

    def _call(self, body: Any, arguments_key: str) -> ToolCall | None:
        """A call from its JSON (text or decoded), or None if it is not one (or names no known
        tool)."""
        if isinstance(body, str):
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                return None
        else:
            value = body
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        args = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(_new_id(), value["name"], json.dumps(args, ensure_ascii=False))


_DECODER = json.JSONDecoder()

# Text up to the first closing marker outside a JSON string (escapes taken whole, so `\"` does
# not end one), or up to a string still open. Linear: `*` can end anywhere, so a match never
# fails and backtracks, and a string takes one character an alternative (an unterminated one
# backs off once). No possessive quantifiers: with Python 3.11.2 (Debian 12's python3) they
# matched past the marker, and CI may build on that python.
_BEFORE_CLOSE = re.compile(rf'(?:[^"<]+|<(?!{re.escape(CLOSE[1:])})|"(?:[^"\\]|\\.)*")*', re.DOTALL)


def _close_of(body: str) -> int:
    """Where the `</tool_call>` that ends a Hermes call's `body` begins, or -1: one inside a
    JSON string is an argument's text (a sampled city named "</tool_call>Paris" cut the call
    there and showed the rest as content), not the end."""
    at = body.find(CLOSE)
    if at < 0 or not body.lstrip().startswith("{"):
        return at  # not JSON: its first marker ends it (the block is dropped as no call)
    match = _BEFORE_CLOSE.match(body)  # never None: the pattern matches the empty string
    end = match.end() if match is not None else 0
    return end if body.startswith(CLOSE, end) else -1


def _partial_suffix(text: str, marker: str) -> int:
    """Where a suffix of `text` that is a proper prefix of `marker` begins (len(text) if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)
