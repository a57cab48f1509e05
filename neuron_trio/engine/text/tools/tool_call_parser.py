"""Reading tool calls back out of one sequence's streamed text, in the model's own syntax.

What counts as a call (`ToolCallFormat.style`):

- hermes: `<tool_call>{…}</tool_call>` blocks anywhere in the output (the text before them
  stays content), and JSON objects with "name" and "arguments" that open the answer without
  the tags, bare or in a Markdown code fence (Qwen2.5-Coder writes its calls so; llama.cpp's
  parser accepts each of these);
- llama3: an answer that is one JSON object with "name" and "parameters" (or "arguments"),
  possibly after `<|python_tag|>`, or several separated by `;`;
- mistral: `[TOOL_CALLS]` followed by a JSON list of calls (or one call);
- mistral_args: `[TOOL_CALLS]name[ARGS]{…}`, repeated for each call (an optional
  `[CALL_ID]…` after the name is skipped).

"arguments" may be an object or a string that holds one. A call names a tool that was
offered, or it is no call. Markup never reaches the content: a block that turns out not to be
a call, a call cut off by the end of the output, and with `cut` (max_tokens) the start of a
marker that might have become one, are dropped (and logged). Whitespace around calls is
dropped too: a streamed answer with several calls shows no `"\\n"` between them.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

from neuron_trio.engine.text.tools.tool_call_format import FENCE, ToolCallFormat, bare_opening
from neuron_trio.engine.types import ToolCall, ToolFunction

__all__ = ["ToolCallParser"]

log = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"

# mistral_args: characters a function's name (and its call id) may take before `[ARGS]`;
# past it the text after `[TOOL_CALLS]` is no call.
MAX_NAME_CHARS = 256


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Separates one sequence's output into content text and tool calls, as it streams.

    `push(text)` returns the content that is safe to show and the calls completed so far; text
    that may be the start of a call is held back until it is known, and whitespace until the
    next word shows that no call follows it.

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
        # Invariant: `_space` is whitespace decided as content but not shown yet; it is shown
        # before the next content, dropped at a call, and at the end shown only if no call came.
        self._space = ""
        self._after_call = False  # content right after a call: its leading whitespace dropped
        # the answer's start, or right after a bare call: a "{" here opens a call
        self._bare = fmt.bare_json
        self._fenced = False  # bare calls inside a code fence: its closing "```" is markup
        self._out: list[str] = []
        self._new: list[ToolCall] = []

    def push(self, text: str, *, final: bool, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """Feed the next text; `final` when the output has ended, `cut` when it ended at
        max_tokens rather than where the model chose to stop."""
        self._pending += text
        while self._pending and self._step(final, cut):
            pass
        if final:
            if self._pending:  # what no step took: the rest of a marker, or text
                self._show(self._pending)
                self._pending = ""
            if not self.calls and not self._new:
                self._out.append(self._space)
            self._space = ""
        out, new = "".join(self._out), self._new
        self._out, self._new = [], []
        self.calls.extend(new)
        return out, new

    def _step(self, final: bool, cut: bool) -> bool:
        """Decide the start of `_pending`; False when nothing more can be decided yet."""
        if self._bare:
            taken = self._bare_step(final, cut)
            if taken is not None:
                return taken
        if self.format.style == "llama3":
            self._show(self._pending)  # no marker: text is content
            self._pending = ""
            return False
        start = self._pending.find(self._open)
        if start < 0:
            keep = len(self._pending)
            if not final or cut:  # the start of a marker stays held (or is dropped at a cut)
                keep = _partial_suffix(self._pending, self._open)
            self._show(self._pending[:keep])
            self._pending = self._pending[keep:]
            if final and cut:
                self._pending = ""
            return False
        self._show(self._pending[:start])
        self._pending = self._pending[start:]
        return self._marked_step(final)

    def _bare_step(self, final: bool, cut: bool) -> bool | None:
        """A call that opens the answer (or follows a bare call) as a JSON object, for Hermes
        also in a code fence; True when taken, False while it is incomplete, None when the
        text here is no such call."""
        text = self._pending
        if self.format.style == "llama3":
            text = text.lstrip().lstrip(";").lstrip()
            if text.startswith(PYTHON_TAG):
                text = text[len(PYTHON_TAG) :]
        if self._fenced:  # the fence's closing line ends the calls
            lead = text.lstrip()
            if lead.startswith(FENCE):
                self._pending, self._fenced = lead[len(FENCE) :], False
                return True
            if FENCE.startswith(lead) and not final:
                return False  # maybe the closing line
        kind, at = bare_opening(text, fences=self.format.style == "hermes" and not self._fenced)
        if kind == "wait":
            if not final:
                return False
            kind = "text"  # the model ended before a call could begin
        if kind == "text":
            if self.format.style == "llama3" and PYTHON_TAG.startswith(text.strip()) and not final:
                return False  # maybe the start of the tag
            if self.format.style == "llama3":
                self._pending = self._pending.replace(PYTHON_TAG, "", 1)  # markup, not text
            self._bare = False
            return None
        lead = text[at:]
        if not final and not lead.rstrip().endswith("}"):
            return False  # an object ends with "}": no decoding of every prefix (quadratic)
        try:
            value, end = _DECODER.raw_decode(lead)
        except json.JSONDecodeError:
            if not final:
                return False  # maybe not complete yet
            if cut or self.format.style == "llama3":
                log.info("dropped an unfinished tool call: %.200s", lead)
                self._pending = ""
                return False
            self._bare = False  # the model ended there: JSON text, not a call
            return None
        if self._take([value], "arguments") or self.format.style == "llama3":
            # llama3: JSON that is no call is dropped, never shown
            self._fenced = self._fenced or FENCE in text[:at]
            self._pending = lead[end:]
            return True
        self._bare = False  # a JSON answer that is not a call: content
        return None

    def _marked_step(self, final: bool) -> bool:
        """`_pending` begins with the opening marker: take its block when it is complete."""
        after = self._pending[len(self._open) :]
        if self.format.style == "hermes":
            found = _hermes_block(after)
        elif self.format.style == "mistral_args":
            found = _named_block(after, final)
        else:
            found = _list_block(after)
        if found is None:  # not complete yet
            if final:
                log.info("dropped an unfinished tool call: %.200s", self._pending)
                self._pending = ""
            return False
        bodies, used = found
        self._take(bodies, "arguments")
        self._pending = after[used:]
        self._bare = self.format.style == "hermes"  # hermes: a bare call may follow
        return True

    def _take(self, bodies: list[Any], key: str) -> bool:
        """Record the calls among `bodies` (JSON text or decoded); whether any was one (a call
        past the first without `parallel`, or the same as an earlier one, is one, dropped:
        Qwen2.5-Coder-0.5B, given a tool's result, wrote its call again and the result's JSON
        after it, which the grammar made a second identical call)."""
        taken = False
        for body in bodies:
            call = self._call(body, key)
            if call is None:
                log.info("dropped tool-call markup that is not a call: %.200s", body)
                continue
            self._space, self._after_call, taken = "", True, True
            earlier = [*self.calls, *self._new]
            if (self.parallel or not earlier) and not any(
                (c.name, c.arguments) == (call.name, call.arguments) for c in earlier
            ):
                self._new.append(call)
        return taken

    def _show(self, text: str) -> None:
        """`text` is content: shown, but for whitespace at its end (held in `_space`)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        self._out.append(body)

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
        key = self.format.arguments_key
        args = value.get(key, value.get(arguments_key, value.get("parameters", {})))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(_new_id(), value["name"], json.dumps(args, ensure_ascii=False))


_DECODER = json.JSONDecoder()


def _list_block(after: str) -> tuple[list[Any], int] | None:
    """mistral: the calls' JSON list (or one object) after `[TOOL_CALLS]` and how many
    characters it takes, or None while it is incomplete."""
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


def _named_block(after: str, final: bool) -> tuple[list[Any], int] | None:
    """mistral_args: `name[ARGS]{…}` after `[TOOL_CALLS]` as a call's JSON, or None while it
    is incomplete; a name too long or without `[ARGS]` at the end is no call (dropped)."""
    if after.lstrip().startswith(("[", "{")):
        return _list_block(after)  # the older list form, which these models may still write
    at = after.find(ARGS)
    if at < 0:
        if len(after) > MAX_NAME_CHARS or final:
            return [after], len(after)
        return None
    name = after[:at].split(CALL_ID, 1)[0].strip()
    body = after[at + len(ARGS) :]
    lead = body.lstrip()
    try:
        value, end = _DECODER.raw_decode(lead)
    except json.JSONDecodeError:
        return None
    used = at + len(ARGS) + len(body) - len(lead) + end
    return [{"name": name, "arguments": value}], used


# Text up to the first closing marker outside a JSON string (escapes taken whole, so `\"` does
# not end one), or up to a string still open. Linear: `*` can end anywhere, so a match never
# fails and backtracks, and a string takes one character an alternative (an unterminated one
# backs off once). No possessive quantifiers: with Python 3.11.2 (Debian 12's python3) they
# matched past the marker, and CI may build on that python.
_BEFORE_CLOSE = re.compile(rf'(?:[^"<]+|<(?!{re.escape(CLOSE[1:])})|"(?:[^"\\]|\\.)*")*', re.DOTALL)


def _hermes_block(after: str) -> tuple[list[Any], int] | None:
    """hermes: the call's JSON text after `<tool_call>` and how many characters the block
    takes with its `</tool_call>`, or None while it is incomplete."""
    end = _close_of(after)
    if end < 0:
        return None
    return [after[:end]], end + len(CLOSE)


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
