"""OpenAI requests: the wire schemas and their validation into a `GenerationJob`.

Requests are decoded with msgspec Structs that forbid unknown fields: a field neuron does not
implement (`audio`, `prediction`, …) is a 400 that names it, never silently ignored. Every
other validation error names its field too (`param` in the error body).

Accepted and ignored on purpose, because they never change the answer (README, "Request
fields"): `user`, `safety_identifier`, `prompt_cache_key` (caller ids and a cache-routing hint
for OpenAI's own servers; neuron's prefix cache finds shared prefixes by itself), `store`
(neuron keeps no completions), `metadata` (bounded as OpenAI bounds it), `service_tier`, a
message's `reasoning_content` (templates drop past thinking),
`verbosity` (no model neuron serves has a verbosity control),
`modalities: ["text"]`, `functions: null`/`function_call: null`. Honoured: `logit_bias`, and a
message's `name` (given to the chat template), `chat_template_kwargs` and
`reasoning_effort` (given to the chat template, `template_kwargs`). `stream_options` needs `stream: true` (a 400
otherwise, as vLLM). `null` for an optional field means "the default".

Defaults are OpenAI's: temperature 1, top_p 1, no penalties; `max_tokens` 16 for
completions; chat without `max_tokens`/`max_completion_tokens` may run to the end of the
model's context (or its configured `default_max_tokens`): `max_tokens` stays None here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec

from neuron_trio.errors import RequestError
from neuron_trio.http.openai.body_decode import decode_struct
from neuron_trio.http.openai.request_schemas import (
    ChatCompletionRequest,
    CommonFields,
    CompletionRequest,
    InputMessage,
    NamedToolChoice,
    PromptField,
)
from neuron_trio.service.api import (
    ChatMessage,
    Constraint,
    GenerationJob,
    SamplingParams,
    ToolCall,
    ToolFunction,
)

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "ParsedRequest",
    "RequestKind",
    "chat_parsed",
    "completion_parsed",
    "completion_prompts",
    "decode_completion_request",
    "decode_struct",
    "parse_chat_request",
]

RequestKind = Literal["chat", "completion"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: the job for the node plus how to shape the response."""

    kind: RequestKind
    job: GenerationJob
    stream: bool
    include_usage: bool
    prompt_chars: int = 0  # completions: where the completion's text offsets start
    system_fingerprint: str | None = None  # the model's, filled in by the app once it is known


# --- requests -> jobs -----------------------------------------------------------------------


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# The request fields that reach SamplingParams as they are, under the same name, when given
# (None: the engine's default). A new plain sampling parameter is a SamplingParams field, a
# bounded CommonFields field of the same name and its use in sampling.py: nothing here.
_SAME_NAMED = tuple(
    name
    for name in SamplingParams.__dataclass_fields__
    if name in CommonFields.__struct_fields__
    and name not in {"max_tokens", "stop", "top_k", "n", "logit_bias"}
)


def _sampling(
    req: CommonFields, *, max_tokens: int | None, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    given = {name: value for name in _SAME_NAMED if (value := getattr(req, name)) is not None}
    return SamplingParams(
        **given,
        max_tokens=max_tokens,  # chat: None runs to the end of the context (or the default)
        top_k=req.top_k if req.top_k is not None and req.top_k > 0 else 0,
        stop=_stops(req.stop),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=req.n or 1,
        logit_bias=_logit_bias(req.logit_bias),
    )


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as strings) as (id, bias) pairs; ids are checked
    against the model's vocabulary when the request reaches it (Engine.prepare)."""
    pairs: list[tuple[int, float]] = []
    for key, bias in (raw or {}).items():
        if not key.isascii() or not key.isdigit() or len(key) > 9:
            raise RequestError(
                f"logit_bias: {key[:32]!r} is not a token id (a non-negative integer)",
                param="logit_bias",
            )
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _refuse_unsupported(req: CommonFields) -> None:
    """400s for fields that parse but cannot be honoured with the values given."""
    if req.stream_options is not None and not req.stream:
        raise RequestError(
            "stream_options: only allowed with stream: true",
            param="stream_options",
            code="invalid_value",
        )


def _refuse_unsupported_chat(req: ChatCompletionRequest) -> None:
    _refuse_unsupported(req)
    for i, modality in enumerate(req.modalities or ()):
        if modality != "text":
            raise RequestError(
                f"modalities[{i}]: {modality[:32]!r} is not supported (only text)",
                param=f"modalities[{i}]",
                code="unsupported_value",
            )
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise RequestError(
                f"{name}: the deprecated function-calling fields are not supported (use tools "
                "and tool_choice)",
                param=name,
                code="unsupported_field",
            )


def _message(i: int, msg: InputMessage) -> ChatMessage:
    where = f"messages[{i}]"
    if msg.content is None:
        content = ""
        if not msg.tool_calls:
            raise RequestError(
                f"{where}.content: required (only an assistant message with tool_calls may omit "
                "it)",
                param=f"{where}.content",
                code="missing_field",
            )
    elif isinstance(msg.content, str):
        content = msg.content
    else:
        content = "\n".join(p.text for p in msg.content)
    if msg.tool_calls and msg.role != "assistant":
        raise RequestError(
            f"{where}.tool_calls: only assistant messages carry tool calls",
            param=f"{where}.tool_calls",
        )
    if msg.role == "tool" and not msg.tool_call_id:
        raise RequestError(
            f"{where}.tool_call_id: required for a message with role tool",
            param=f"{where}.tool_call_id",
            code="missing_field",
        )
    calls = tuple(
        ToolCall(c.id, c.function.name, _json_object(c.function.arguments, f"{where}.tool_calls"))
        for c in msg.tool_calls or ()
    )
    role: Literal["system", "user", "assistant", "tool"] = (
        "system" if msg.role == "developer" else msg.role
    )
    return ChatMessage(
        role=role,
        content=content,
        tool_calls=calls,
        tool_call_id=msg.tool_call_id,
        name=msg.name,
    )


def _json_object(text: str, param: str) -> str:
    """`text` if it is a JSON object (a call's arguments), else a RequestError naming `param`."""
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        value = None
    if not isinstance(value, dict):
        raise RequestError(f"{param}: arguments must be a JSON object as a string", param=param)
    return text


def _compact(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _constraint(req: ChatCompletionRequest) -> tuple[Constraint | None, tuple[ToolFunction, ...]]:
    """The grammar the answer must follow, and the tools whose calls are parsed from it."""
    tools = tuple(
        ToolFunction(
            name=t.function.name,
            description=t.function.description or "",
            parameters=_compact(
                t.function.parameters
                if t.function.parameters is not None
                else {"type": "object", "properties": {}}
            ),
            strict=bool(t.function.strict),
        )
        for t in req.tools or ()
    )
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools: two functions have the same name", param="tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    fmt = req.response_format
    if fmt is not None and fmt.type != "text" and tools and choice != "none":
        raise RequestError(
            "response_format: cannot be combined with tools (unless tool_choice is none)",
            param="response_format",
        )
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.name == choice.function.name]
        if not chosen:
            raise RequestError(
                f"tool_choice: no function named {choice.function.name!r} in tools",
                param="tool_choice",
                code="unknown_function",
            )
        return Constraint("tool_call", tools=(chosen[0],)), tools
    if choice == "required":
        if not tools:
            raise RequestError("tool_choice: required needs tools", param="tool_choice")
        parallel = req.parallel_tool_calls is not False
        return Constraint("tool_call", tools=tools, parallel=parallel), tools
    if choice == "auto":
        if not tools:
            raise RequestError("tool_choice: auto needs tools", param="tool_choice")
        return None, tools
    # choice "none": the tools are neither offered to the model nor parsed
    if fmt is None or fmt.type == "text":
        return None, ()
    if fmt.type == "json_object":
        return Constraint("json", schema='{"type":"object"}'), ()
    if fmt.json_schema is None:
        raise RequestError(
            "response_format.json_schema: required with type json_schema",
            param="response_format.json_schema",
            code="missing_field",
        )
    schema = fmt.json_schema.schema if fmt.json_schema.schema is not None else {}
    strict = bool(fmt.json_schema.strict)  # OpenAI's strict mode: objects closed
    return Constraint("json", schema=_compact(schema), strict=strict), ()


def _salt(cache_salt: str | None) -> bytes | None:
    return cache_salt.encode() if cache_salt is not None else None


def _include_usage(req: CommonFields) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def parse_chat_request(body: bytes) -> ParsedRequest:
    """Validate a `/v1/chat/completions` body; RequestError names the offending field."""
    return chat_parsed(decode_struct(body, ChatCompletionRequest))


def chat_parsed(req: ChatCompletionRequest) -> ParsedRequest:
    """A decoded chat request validated into its job (the Responses API builds its request
    as a `ChatCompletionRequest` and comes here too); RequestError names the field."""
    _refuse_unsupported_chat(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError(
            "top_logprobs: needs logprobs = true", param="top_logprobs", code="invalid_value"
        )
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    params = _sampling(
        req,
        max_tokens=max_tokens,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
    )
    constraint, tools = _constraint(req)
    parallel = req.parallel_tool_calls is not False
    params = replace(params, constraint=constraint, tools=tools, parallel_tool_calls=parallel)
    messages = tuple(_message(i, m) for i, m in enumerate(req.messages))
    job = GenerationJob(
        model=req.model,
        params=params,
        messages=messages,
        cache_salt=_salt(req.cache_salt),
        template_kwargs=template_kwargs(req.chat_template_kwargs, req.reasoning_effort),
    )
    return ParsedRequest("chat", job, bool(req.stream), _include_usage(req))


# Names a chat template gets from neuron itself: a request's `chat_template_kwargs` may not
# set them (the messages, the tools, the special tokens' texts, the template's helpers).
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
        "tojson",
    }
)


def template_kwargs(
    given: dict[str, Any] | None, reasoning_effort: str | None
) -> tuple[tuple[str, Any], ...]:
    """The names a chat request gives its template (`chat_template_kwargs`, and
    `reasoning_effort` unless they set it); RequestError naming a name neuron sets."""
    names = dict(given or {})
    taken = sorted(RESERVED_TEMPLATE_NAMES & names.keys())
    if taken:
        raise RequestError(
            f"chat_template_kwargs: {taken[0]!r} is set by the server, not the request",
            param="chat_template_kwargs",
            code="invalid_value",
        )
    if reasoning_effort is not None:
        names.setdefault("reasoning_effort", reasoning_effort)
    return tuple(sorted(names.items()))


def decode_completion_request(body: bytes) -> CompletionRequest:
    """Decode a `/v1/completions` body and refuse what no prompt of it can honour."""
    req = decode_struct(body, CompletionRequest)
    _refuse_unsupported(req)
    if req.suffix:
        raise RequestError("suffix: not supported", param="suffix", code="unsupported_field")
    if req.best_of is not None and req.best_of != 1:
        raise RequestError("best_of: not supported", param="best_of", code="unsupported_field")
    return req


def completion_parsed(req: CompletionRequest, prompt: str | tuple[int, ...]) -> ParsedRequest:
    """The request for one of `req`'s prompts (text, or token ids used as they are)."""
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    params = _sampling(
        req,
        max_tokens=max_tokens,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
    )
    text = prompt if isinstance(prompt, str) else ""
    job = GenerationJob(
        model=req.model,
        params=params,
        prompt=text if isinstance(prompt, str) else None,
        prompt_ids=None if isinstance(prompt, str) else prompt,
        cache_salt=_salt(req.cache_salt),
    )
    # Text offsets in completion logprobs count from the end of a text prompt; for token ids
    # (whose text the HTTP layer does not decode) they count from the completion's start.
    return ParsedRequest("completion", job, bool(req.stream), _include_usage(req), len(text))


def completion_prompts(raw: PromptField) -> list[str | tuple[int, ...]]:
    """The prompts of a `prompt` field, as OpenAI reads it: a string; a list of strings; a
    list of ints (one prompt of token ids); a list of lists of ints (several)."""
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise RequestError("prompt: an empty list", param="prompt")
    if all(isinstance(item, int) for item in raw):
        return [tuple(int(item) for item in raw)]  # type: ignore[arg-type]
    if isinstance(raw[0], int):  # ids, then something else: name the first non-id
        i = next(k for k, item in enumerate(raw) if not isinstance(item, int))
        raise RequestError(
            f"prompt[{i}]: a prompt of token ids holds ints only (for several prompts, a list "
            "of lists of ints)",
            param=f"prompt[{i}]",
        )
    prompts: list[str | tuple[int, ...]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item:
            prompts.append(tuple(item))
        else:
            raise RequestError(
                f"prompt[{i}]: a string, or a non-empty list of token ids (not a mix of "
                "strings and ids in one list)",
                param=f"prompt[{i}]",
            )
    return prompts
