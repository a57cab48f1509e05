"""The Responses API (`POST /v1/responses`): its request, turned into a chat job, and its
`response` object.

A Responses request is a chat in another shape: `instructions` is a system message, `input`
a string (one user message) or a list of items (messages, the model's earlier
`function_call`s and their `function_call_output`s), `tools` are functions written flat
(`{"type": "function", "name", "parameters"}`). `parse_responses_request` builds it as a
`ChatCompletionRequest` (the Structs a chat body decodes into, no JSON in between) and
validates that as chat does (`requests.chat_parsed`), so that every chat rule (templates,
tool calls, schemas, limits, each field's 400) applies unchanged. What neuron cannot honour is a 400 naming it: built-in
tools (web search, files, …), images, `truncation: "auto"`, `include` items, `background`.

The answer is a list of output items: one `message` (its `output_text`), then one
`function_call` item per call the model made.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from neuron_trio.errors import RequestError
from neuron_trio.http.openai.body_decode import decode_struct
from neuron_trio.http.openai.request_schemas import (
    ChatCompletionRequest,
    FunctionCallIn,
    FunctionDef,
    FunctionName,
    InputMessage,
    JsonSchemaFormat,
    MaxTokens,
    ModelId,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Temperature,
    ToolCallIn,
    ToolDef,
    TopP,
)
from neuron_trio.http.openai.requests import ParsedRequest, chat_parsed
from neuron_trio.http.openai.responses import ChoiceTranscript, Transcript

__all__ = [
    "MAX_INPUT_ITEMS",
    "ParsedResponsesRequest",
    "ResponsesRequest",
    "new_item_id",
    "parse_responses_request",
    "response_object",
    "responses_usage",
]

MAX_INPUT_ITEMS = 1024  # the body limit bounds the bytes; this, the work per item


class ResponsesTextFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponsesText(msgspec.Struct, forbid_unknown_fields=True):
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: no effect here


class ResponsesTool(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # "function"; any other (web_search, file_search, …) is refused by name
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class Reasoning(msgspec.Struct, forbid_unknown_fields=True):
    # `effort` goes to the chat template as `reasoning_effort` (as chat's field does); the
    # summary fields are accepted and ignored (neuron writes no summaries).
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # no obfuscation padding is ever sent


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: ModelId
    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: ResponsesText | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None  # default true: kept for `previous_response_id` (bounded)
    metadata: Annotated[dict[str, str], msgspec.Meta(max_length=16)] | None = None  # echoed
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    reasoning: Reasoning | None = None
    # Accepted and ignored: caller metadata and routing hints that never change the answer.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None


@dataclass(frozen=True)
class ParsedResponsesRequest:
    """A validated Responses request: the chat job, and what the response echoes back."""

    request: ResponsesRequest
    chat: ParsedRequest
    # the conversation so far, as chat messages (without `instructions`): what a later
    # request naming this one as `previous_response_id` continues from
    history: tuple[InputMessage, ...]

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _refuse(param: str, why: str) -> RequestError:
    return RequestError(f"{param}: {why}", param=param, code="unsupported_value")


def _text_of(content: Any, where: str) -> str:
    """The text of an item's `content`: a string, or parts of type input_text/output_text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: a string or a list of text parts", param=where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise _refuse(f"{where}[{k}]", f"content of type {kind!r} is not supported (text only)")
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(
            f"{where}.{key}: required, a string", param=f"{where}.{key}", code="missing_field"
        )
    return value


def _input_messages(items: list[dict[str, Any]]) -> list[InputMessage]:
    """The chat messages for a list of input items (consecutive calls: one assistant turn)."""
    messages: list[InputMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(
                    f"{where}.role: one of user, system, developer, assistant",
                    param=f"{where}.role",
                )
            text = _text_of(item.get("content"), f"{where}.content")
            messages.append(InputMessage(role=role, content=text))
        elif kind == "function_call":
            function = FunctionCallIn(
                name=_string(item, "name", where), arguments=_string(item, "arguments", where)
            )
            call = ToolCallIn(id=_string(item, "call_id", where), function=function)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None:
                last.tool_calls.append(call)
            else:
                messages.append(InputMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                InputMessage(
                    role="tool",
                    tool_call_id=_string(item, "call_id", where),
                    content=_text_of(output, f"{where}.output"),
                )
            )
        elif kind == "reasoning":
            continue  # a reasoning item sent back: templates drop past thinking anyway
        else:
            raise _refuse(f"{where}.type", f"input items of type {kind!r} are not supported")
    return messages


def _chat_tools(tools: list[ResponsesTool] | None) -> list[ToolDef] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise _refuse(f"tools[{i}].type", f"built-in tool {tool.type!r} is not supported")
        if tool.name is None:
            raise RequestError(
                f"tools[{i}].name: required", param=f"tools[{i}].name", code="missing_field"
            )
        function = FunctionDef(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        out.append(ToolDef(type="function", function=function))
    return out


def _response_format(text: ResponsesText | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.name is None:
        raise RequestError(
            "text.format.name: required with type json_schema",
            param="text.format.name",
            code="missing_field",
        )
    if fmt.schema is None:  # OpenAI requires it (chat's json_schema may omit it: any JSON)
        raise RequestError(
            "text.format.schema: required with type json_schema",
            param="text.format.schema",
            code="missing_field",
        )
    schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema, strict=fmt.strict)
    return ResponseFormat(type="json_schema", json_schema=schema)


def _tool_choice(
    choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None,
) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    if isinstance(choice, NamedFunctionChoice):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return choice


def parse_responses_request(
    body: bytes, previous: tuple[InputMessage, ...] | None = None
) -> ParsedResponsesRequest:
    """Validate a `/v1/responses` body; `previous` is the history of the response named by
    its `previous_response_id` (looked up by the caller). RequestError names the field."""
    req = decode_struct(body, ResponsesRequest)
    if req.truncation == "auto":
        raise _refuse("truncation", '"auto" is not supported (an input too long is a 400)')
    if req.include:
        raise _refuse("include", f"{req.include[0]!r} is not supported")
    if req.background:
        raise _refuse("background", "background responses are not supported")
    if req.previous_response_id is not None and previous is None:
        raise RequestError(
            "previous_response_id: needs the earlier response", param="previous_response_id"
        )
    if isinstance(req.input, str):
        new = [InputMessage(role="user", content=req.input)]
    else:
        new = _input_messages(req.input)
    history = (*(previous or ()), *new)
    if not history:
        raise RequestError("input: no input items", param="input")
    system = [InputMessage(role="system", content=req.instructions)] if req.instructions else []
    # Every value below was decoded into a field of the same bound as chat's (ModelId,
    # MaxTokens, FunctionName, ...), so the Struct holds what a chat body could.
    chat = ChatCompletionRequest(
        model=req.model,
        messages=[*system, *history],
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=_chat_tools(req.tools),
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
    )
    return ParsedResponsesRequest(req, chat_parsed(chat), history)


# --- the response object -----------------------------------------------------------------


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [output_text_part(text)],
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A thinking model's thinking, as OpenAI's SDK reads a `reasoning` item (the text as
    `reasoning_text` content, as vLLM sends it; no summary)."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_items(choice: ChoiceTranscript) -> list[dict[str, Any]]:
    """The output of a finished answer: its thinking (a thinking model's) as a reasoning
    item, its text (if any, or if there is nothing else) as a message, then its function
    calls."""
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    items = []
    if choice.reasoning:
        items.append(reasoning_item(new_item_id("rs"), choice.reasoning, status))
    text = choice.text.strip() if choice.tool_calls else choice.text
    if text or not choice.tool_calls:
        items.append(message_item(new_item_id("msg"), text, status))
    for call in choice.tool_calls:
        items.append(
            function_call_item(new_item_id("fc"), call.id, call.name, call.arguments, "completed")
        )
    return items


def history_of(output: list[dict[str, Any]]) -> list[InputMessage]:
    """The answer as chat messages, for the next turn's `previous_response_id`."""
    return _input_messages(
        [
            {"type": "message", "role": "assistant", "content": item["content"][0]["text"]}
            if item["type"] == "message"
            else item
            for item in output
        ]
    )


def responses_usage(t: Transcript) -> dict[str, Any]:
    return {
        "input_tokens": t.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": t.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},  # not counted apart
        "total_tokens": t.prompt_tokens + t.completion_tokens,
    }


def response_object(
    parsed: ParsedResponsesRequest,
    response_id: str,
    created_at: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The `response` object: at creation (`in_progress`, no output) and at the end."""
    req = parsed.request
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {
            "effort": req.reasoning.effort if req.reasoning is not None else None,
            "summary": None,
        },
        "store": req.store is not False,
        "temperature": parsed.chat.job.params.temperature,
        "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
        "tool_choice": msgspec.to_builtins(req.tool_choice) if req.tool_choice else "auto",
        "tools": [msgspec.to_builtins(t) for t in req.tools or ()],
        "top_p": parsed.chat.job.params.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }
