"""How a model writes a tool call, and the Lark grammar that holds its calls to the tools.

Four formats: Hermes-style `<tool_call>{json}</tool_call>` (Qwen, and neuron's fallback for
templates without tools; the same JSON without the tags when it is the whole answer, as
Qwen2.5-Coder writes it), Llama 3.x's bare JSON object with "name" and "parameters",
Mistral's `[TOOL_CALLS]` followed by a JSON list of calls, and newer Mistral templates'
`[TOOL_CALLS]name[ARGS]{json}` ("mistral_args"). `detect_tool_format` reads which one from
the model's chat template (or takes the model's `tool_call_format` setting);
`ToolCallFormat.lark` writes the grammar that `grammar.GrammarCompiler` compiles, after each
tool's schema is bounded and prepared.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Protocol

from neuron_trio.engine.text.structured.schema_limits import check_schema, check_size, schema_bytes
from neuron_trio.engine.text.structured.schema_prep import close_objects, rebase_refs
from neuron_trio.engine.types import ToolFunction
from neuron_trio.errors import RequestError

_CALL_JSON_OPTIONS: Any = {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}

# Calls in one constrained turn with `parallel_tool_calls` (OpenAI's default). Unbounded, a
# small model asked for `required` repeats calls until max_tokens and the last one is cut off
# mid-JSON; at the bound the grammar allows only the end of the turn.
MAX_PARALLEL_TOOL_CALLS = 4

# The styles a model's `tool_call_format` setting may name ("auto": read from the template).
STYLES = ("hermes", "llama3", "mistral", "mistral_args")


# A Markdown code fence's opening line before a call's JSON (Qwen2.5-Coder writes its calls in
# "```json" fences), and what may still become one; the language name bounded.
_FENCE = re.compile(r"```[A-Za-z]{0,16}[ \t]{0,4}\n\s*")
_FENCE_START = re.compile(r"`{1,3}|```[A-Za-z]{0,16}[ \t]{0,4}")
FENCE = "```"


def bare_opening(text: str, *, fences: bool) -> tuple[str, int]:
    """What the answer's text so far says about a call without a marker: ("call", where its
    `{` is) when it opens with a JSON object (after whitespace, and with `fences` a code
    fence's opening line), ("wait", 0) while it may still, ("text", 0) when it cannot."""
    lead = text.lstrip()
    at = len(text) - len(lead)
    if not lead:
        return "wait", 0
    if lead.startswith("{"):
        return "call", at
    if not fences or not lead.startswith("`"):
        return "text", 0
    match = _FENCE.match(lead)
    if match is None:
        return ("wait", 0) if _FENCE_START.fullmatch(lead) else ("text", 0)
    rest = lead[match.end() :]
    if not rest:
        return "wait", 0
    return ("call", at + match.end()) if rest.startswith("{") else ("text", 0)


class _Vocabulary(Protocol):
    special_ids: frozenset[int]

    def token_to_id(self, text: str) -> int | None: ...


class ToolCallFormat:
    """How a model writes a tool call: Hermes-style `<tool_call>{json}</tool_call>` (Qwen,
    and neuron's fallback for templates without tools), Llama 3.x's bare JSON object with
    "name" and "parameters", Mistral's `[TOOL_CALLS]` followed by a JSON list of calls, or
    `[TOOL_CALLS]name[ARGS]{json}` (newer Mistral templates: "mistral_args")."""

    def __init__(
        self, style: str, open_token_id: int | None = None, args_token_id: int | None = None
    ) -> None:
        assert style in STYLES, style
        self.style = style
        # the opening marker (`<tool_call>`, `[TOOL_CALLS]`) when it is one special token
        self.open_token_id = open_token_id
        # mistral_args: `[ARGS]` when it is one special token
        self.args_token_id = args_token_id
        self.arguments_key = "parameters" if style == "llama3" else "arguments"

    @property
    def marker(self) -> str:
        """The text that opens a call ("" for llama3, whose call is the answer's JSON)."""
        if self.style == "hermes":
            return "<tool_call>"
        return "[TOOL_CALLS]" if self.style.startswith("mistral") else ""

    @property
    def bare_json(self) -> bool:
        """Whether an answer that opens with `{` is a call without a marker."""
        return self.style in ("hermes", "llama3")

    def opening(self) -> str:
        """The Lark element of the opening marker."""
        if self.open_token_id is not None:
            return f"<[{self.open_token_id}]>"
        return json.dumps(self.marker)

    def call_schema(self, tool: ToolFunction, parameters: Any = None) -> dict[str, Any]:
        """The JSON Schema of one call to `tool`; `parameters`: its arguments' schema,
        prepared (`prepare_parameters`), else the tool's own text."""
        return {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                self.arguments_key: (
                    json.loads(tool.parameters) if parameters is None else parameters
                ),
            },
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }

    def prepare_parameters(
        self, tools: Sequence[ToolFunction], *, closed: bool = False
    ) -> list[Any]:
        """Each tool's parameters, decoded, bounded (`schema_limits`), closed under `strict`
        (with `closed`, every tool's objects that list their properties are closed too) and
        with local `$ref`s pointing where `lark` puts them; RequestError naming the tool."""
        prepared = []
        for index, tool in enumerate(tools):
            param = f"tools[{tool.name}].function.parameters"
            text_bytes = schema_bytes(tool.parameters)  # UTF-8 bytes, not characters
            check_size(text_bytes, param=param)
            parameters = decode_schema(tool.parameters, param)
            check_schema(parameters, param=param, size=text_bytes)
            if tool.strict or closed:
                close_objects(parameters, listed_only=not tool.strict)
            at = f"/properties/{self.arguments_key}"
            if self.style == "mistral_args":
                at = ""  # the arguments are a document of their own (`named_calls`)
            elif len(tools) > 1:
                at = f"/anyOf/{index}{at}"
            rebase_refs(parameters, at, param=param)
            prepared.append(parameters)
        return prepared

    def call_json(
        self, tools: Sequence[ToolFunction], parameters: Sequence[Any] | None = None
    ) -> str:
        """The Lark element of one call's JSON object, to one of `tools`; `parameters`:
        their prepared schemas (`prepare_parameters`, which runs here when None)."""
        if parameters is None:
            parameters = self.prepare_parameters(tools)
        calls = [self.call_schema(t, a) for t, a in zip(tools, parameters, strict=True)]
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        # At most one space between tokens: models write `{"name": "f"}` (a space after the
        # colon), and without a bound a tie among whitespace tokens fills max_tokens with it.
        schema = {**schema, "x-guidance": _CALL_JSON_OPTIONS}
        return "%json " + json.dumps(schema, separators=(",", ":"))

    def named_calls(
        self, tools: Sequence[ToolFunction], parameters: Sequence[Any] | None = None
    ) -> str:
        """mistral_args: Lark rules `named` (one tool's name, `[ARGS]`, its arguments' JSON)
        and one `args_<i>` a tool."""
        if parameters is None:
            parameters = self.prepare_parameters(tools)
        args = f"<[{self.args_token_id}]>" if self.args_token_id is not None else '"[ARGS]"'
        names = " | ".join(f"{json.dumps(t.name)} {args} args_{i}" for i, t in enumerate(tools))
        rules = [f"named: {names}"]
        for i, schema in enumerate(parameters):
            schema = (
                {**schema, "x-guidance": _CALL_JSON_OPTIONS} if isinstance(schema, dict) else schema
            )
            rules.append(f"args_{i}: %json " + json.dumps(schema, separators=(",", ":")))
        return "\n".join(rules) + "\n"

    def lark(
        self,
        tools: Sequence[ToolFunction],
        parallel: bool,
        parameters: Sequence[Any] | None = None,
    ) -> str:
        """A Lark grammar for one call (or several, with `parallel`) to one of `tools`;
        `parameters`: their prepared schemas (`prepare_parameters`)."""
        more = f"{{0,{MAX_PARALLEL_TOOL_CALLS - 1}}}"
        opening = self.opening()
        if self.style == "mistral_args":
            start = f"call{{1,{MAX_PARALLEL_TOOL_CALLS}}}" if parallel else "call"
            return f"start: {start}\ncall: {opening} named\n" + self.named_calls(tools, parameters)
        body = self.call_json(tools, parameters)
        if self.style == "mistral":
            calls = f'call ("," call){more}' if parallel else "call"
            return f'start: {opening} "[" {calls} "]"\ncall: {body}\n'
        if self.style == "llama3":
            call = body
            sep = '";"'
        else:
            call = f'{opening} "\\n" {body} "\\n</tool_call>"'
            sep = '"\\n"'
        start = f"call ({sep} call){more}" if parallel else "call"
        return f"start: {start}\ncall: {call}\n"


def decode_schema(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RequestError(
            f"{param}: invalid JSON schema: {exc}", param=param, code="invalid_schema"
        ) from None


def detect_tool_format(
    tokenizer: _Vocabulary, template_source: str | None, style: str = "auto"
) -> ToolCallFormat:
    """The tool-call format of a model: `style` when it names one (the model's
    `tool_call_format` setting), else what its template writes: Mistral's `[TOOL_CALLS]`
    (`name[ARGS]{…}` when the template has `[ARGS]`) or Llama 3.x's JSON, else Hermes-style.
    Markers are used as one token when the vocabulary has them as special tokens."""
    if style == "auto":
        style = _style_of(template_source or "")
    if style.startswith("mistral"):
        return ToolCallFormat(
            style, _special_id(tokenizer, "[TOOL_CALLS]"), _special_id(tokenizer, "[ARGS]")
        )
    if style == "llama3":
        return ToolCallFormat("llama3")
    return ToolCallFormat("hermes", _special_id(tokenizer, "<tool_call>"))


def _style_of(source: str) -> str:
    if "[TOOL_CALLS]" in source:
        return "mistral_args" if "[ARGS]" in source else "mistral"
    if "<|python_tag|>" in source or ("ipython" in source and "<|eot_id|>" in source):
        return "llama3"
    return "hermes"


def _special_id(tokenizer: _Vocabulary, text: str) -> int | None:
    """The id of `text` when the vocabulary has it as one special token."""
    token_id = tokenizer.token_to_id(text)
    return token_id if token_id is not None and token_id in tokenizer.special_ids else None
