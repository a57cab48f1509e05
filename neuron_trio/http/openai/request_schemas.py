"""The OpenAI request bodies neuron reads, as msgspec Structs, with every field's bound.

Unknown fields are refused (`forbid_unknown_fields`): a field neuron does not implement is a
400 that names it. Which fields are accepted and ignored, and why, is in `requests.py`'s
docstring; `requests.py` validates a decoded body into a `GenerationJob`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]  # -1 (vLLM's "off") and 0 both mean off
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=10.0)]
Seed = Annotated[int, msgspec.Meta(ge=_INT64_MIN, le=_INT64_MAX)]
StopList = Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(max_length=4)]
Stop = Annotated[str, msgspec.Meta(min_length=1)] | StopList
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
# Longer than any model name (config.ModelName: 128) and bounded, so a 900 KB `model` is a
# 400 that does not echo it, not a 404 carrying it into the log.
ModelId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# Prefix-cache isolation (http/tenancy.py): requests share cached prompt blocks only with
# requests of the same salt. Use a high-entropy value (a salt can be guessed like a prompt).
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
CallerId = Annotated[str, msgspec.Meta(max_length=1024)]  # user, safety_identifier, ...
# OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512
Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=16),
]
LogitBias = Annotated[
    dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]], msgspec.Meta(max_length=1024)
]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)]
PromptField = str | list[str | TokenId | list[TokenId]]


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class FunctionCallIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCallIn
    type: Literal["function"] = "function"


class InputMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant message of tool calls
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    name: Annotated[str, msgspec.Meta(max_length=256)] | None = None  # given to the template
    # an assistant's earlier thinking, as a thinking model's answer carried it: accepted and
    # not shown to the template (which drops past thinking: Qwen3's, DeepSeek-R1's)
    reasoning_content: str | None = None


FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
# Names for the chat template (`enable_thinking`, …): a few scalars, as identifiers.
TemplateName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
TemplateValue = Annotated[str, msgspec.Meta(max_length=256)] | int | float | bool | None
TemplateKwargs = Annotated[dict[TemplateName, TemplateValue], msgspec.Meta(max_length=16)]


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # enforced when constrained; true also closes objects


class ToolDef(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # always enforced; true also closes objects (OpenAI's strict)


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None


class CommonFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: ModelId
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    max_tokens: MaxTokens | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=8)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None  # token id (as a string) -> bias added to its logit
    # Accepted and ignored (they never change the answer): see the module docstring.
    user: CallerId | None = None
    safety_identifier: CallerId | None = None
    prompt_cache_key: CallerId | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    cache_salt: CacheSalt | None = None


class ChatCompletionRequest(CommonFields, kw_only=True):
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Given to the chat template (a template that reads it: gpt-oss's, some thinking models');
    # others ignore it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: TemplateKwargs | None = None  # vLLM's and llama.cpp's field
    # Accepted and ignored: no model neuron serves has a verbosity control.
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: Annotated[list[str], msgspec.Meta(max_length=4)] | None = None  # ["text"] only
    # The deprecated forms of tools: accepted only as null (clients send `functions: null`).
    functions: Any = None
    function_call: Any = None


class CompletionRequest(CommonFields, kw_only=True):
    # a string, a list of strings, one prompt as token ids (a list of ints), or a list of
    # such lists: one choice set per prompt (`completion_batch` bounds their number)
    prompt: PromptField
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool | None = None  # the prompt's text before each choice's
    # Declared only to refuse them by name with a clear message (defaults are harmless).
    suffix: str | None = None
    best_of: int | None = None
