"""The OpenAI wire format: request schemas, validation into a `GenerationJob`, response shapes.

Requests are decoded with msgspec Structs that forbid unknown fields: a field neuron does not
implement (`tools`, `response_format`, `logit_bias`, …) is a 400 that names it, never silently
ignored. Every other validation error names its field too (`param` in the error body).

Accepted and ignored on purpose: `user` (an end-user id for the caller's own abuse tracking;
metadata that never changes the output). `stream_options` without `stream` is accepted and
has no effect. `null` for an optional field means "the default".

Defaults are OpenAI's: temperature 1, top_p 1, no penalties; `max_tokens` 16 for
completions; for chat without `max_tokens`/`max_completion_tokens` the engine's default
(`SamplingParams.max_tokens`) applies.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from neuron_trio.errors import RequestError
from neuron_trio.service.api import (
    ChatMessage,
    GenerationJob,
    SamplingParams,
    SequenceEvent,
    TokenLogprob,
)

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "ParsedRequest",
    "Transcript",
    "decode_struct",
    "error_body",
    "parse_chat_request",
    "parse_completion_request",
]

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
ModelId = Annotated[str, msgspec.Meta(min_length=1)]

S = TypeVar("S", bound=msgspec.Struct)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class InputMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
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
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored: caller metadata


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None


class CompletionRequest(_Common, kw_only=True):
    # a string, a list of one string, or one prompt as token ids (a list of ints)
    prompt: str | list[str | int]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # Declared only to refuse them by name with a clear message (defaults are harmless).
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: the job for the node plus how to shape the response."""

    kind: Literal["chat", "completion"]
    job: GenerationJob
    stream: bool
    include_usage: bool
    prompt_chars: int = 0  # completions: where the completion's text offsets start


# --- errors -------------------------------------------------------------------------------


def error_body(
    message: str,
    *,
    error_type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """The one error shape of every non-2xx response and of a mid-stream SSE error event."""
    return {"error": {"message": message, "type": error_type, "code": code, "param": param}}


_AT_RE = re.compile(r"^(?P<detail>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_UNKNOWN_RE = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$")
_MISSING_RE = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _validation_error(
    exc: msgspec.ValidationError, body: bytes, cls: type[msgspec.Struct]
) -> RequestError:
    """Turn msgspec's "… - at `$.a[0].b`" into a RequestError naming `a[0].b`."""
    text = str(exc)
    match = _AT_RE.match(text)
    detail, path = (match["detail"], match["path"].removeprefix(".")) if match else (text, "")
    unknown = _UNKNOWN_RE.match(detail)
    if unknown:
        names = [_join(path, unknown["name"])]
        if not path:
            names = _all_unknown_fields(body, cls) or names
        joined = ", ".join(names)
        return RequestError(
            f"unsupported field(s): {joined}", param=names[0], code="unsupported_field"
        )
    missing = _MISSING_RE.match(detail)
    if missing:
        name = _join(path, missing["name"])
        return RequestError(f"{name}: required field is missing", param=name, code="missing_field")
    if not path:
        return RequestError(f"request body: {detail}", code="invalid_body")
    return RequestError(f"{path}: {detail}", param=path, code="invalid_value")


def _all_unknown_fields(body: bytes, cls: type[msgspec.Struct]) -> list[str]:
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return []
    if not isinstance(data, dict):
        return []
    return sorted(set(data) - set(cls.__struct_fields__))


def decode_struct(body: bytes, cls: type[S]) -> S:
    """Decode a JSON body into `cls`; RequestError (400) names the field that is wrong."""
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc, body, cls) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec's own depth limit, e.g. in a field nobody reads
        raise RequestError("request body is nested too deeply", code="invalid_json") from None


# --- requests -> jobs -----------------------------------------------------------------------


def _common_checks(req: _Common) -> None:
    if req.n is not None and req.n != 1:
        raise RequestError("n: only n = 1 is supported", param="n", code="unsupported_value")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _sampling(
    req: _Common, *, max_tokens: int | None, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    defaults = SamplingParams()
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else defaults.max_tokens,
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=defaults.min_p if req.min_p is None else req.min_p,
        repetition_penalty=(
            defaults.repetition_penalty
            if req.repetition_penalty is None
            else req.repetition_penalty
        ),
        presence_penalty=defaults.presence_penalty
        if req.presence_penalty is None
        else req.presence_penalty,
        frequency_penalty=(
            defaults.frequency_penalty if req.frequency_penalty is None else req.frequency_penalty
        ),
        seed=req.seed,
        stop=_stops(req.stop),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def _message(msg: InputMessage) -> ChatMessage:
    content = (
        msg.content if isinstance(msg.content, str) else "\n".join(p.text for p in msg.content)
    )
    role: Literal["system", "user", "assistant"] = "system" if msg.role == "developer" else msg.role
    return ChatMessage(role=role, content=content)


def _include_usage(req: _Common) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def parse_chat_request(body: bytes) -> ParsedRequest:
    """Validate a `/v1/chat/completions` body; RequestError names the offending field."""
    req = decode_struct(body, ChatCompletionRequest)
    _common_checks(req)
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
    job = GenerationJob(
        model=req.model, params=params, messages=tuple(_message(m) for m in req.messages)
    )
    return ParsedRequest("chat", job, bool(req.stream), _include_usage(req))


def parse_completion_request(body: bytes) -> ParsedRequest:
    """Validate a `/v1/completions` body; RequestError names the offending field."""
    req = decode_struct(body, CompletionRequest)
    _common_checks(req)
    if req.echo:
        raise RequestError("echo: not supported", param="echo", code="unsupported_field")
    if req.suffix:
        raise RequestError("suffix: not supported", param="suffix", code="unsupported_field")
    if req.best_of is not None and req.best_of != 1:
        raise RequestError("best_of: not supported", param="best_of", code="unsupported_field")
    prompt, prompt_ids = _one_prompt(req.prompt)
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    params = _sampling(
        req,
        max_tokens=max_tokens,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
    )
    job = GenerationJob(
        model=req.model,
        params=params,
        prompt=None if prompt_ids is not None else prompt,
        prompt_ids=prompt_ids,
    )
    return ParsedRequest("completion", job, bool(req.stream), _include_usage(req), len(prompt))


def _one_prompt(raw: str | list[str | int]) -> tuple[str, tuple[int, ...] | None]:
    """(text, None) for a text prompt; ("", ids) for a prompt given as token ids.

    Text offsets in completion logprobs count from the end of a text prompt; for token ids
    (whose text the HTTP layer does not decode) they count from the completion's start.
    """
    if isinstance(raw, str):
        return raw, None
    if raw and all(isinstance(item, int) for item in raw):
        return "", tuple(int(item) for item in raw)
    if len(raw) == 1 and isinstance(raw[0], str):
        return raw[0], None
    if all(isinstance(item, str) for item in raw):
        raise RequestError(
            "prompt: exactly one prompt per request is supported",
            param="prompt",
            code="unsupported_value",
        )
    raise RequestError(
        "prompt: a string, a list of one string, or a list of token ids (ints), not a mix",
        param="prompt",
    )


# --- responses ------------------------------------------------------------------------------


@dataclass
class Transcript:
    """Everything one request's events said, for the response body and the usage."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    def add(self, event: SequenceEvent) -> None:
        if event.text:
            self.text_parts.append(event.text)
        if event.logprobs:
            self.logprobs.extend(event.logprobs)
        if event.prompt_tokens:
            self.prompt_tokens = event.prompt_tokens
        if event.completion_tokens:
            self.completion_tokens = event.completion_tokens
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.error = event.error

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def new_id(kind: Literal["chat", "completion"]) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.text,
                "logprob": lp.logprob,
                "bytes": _token_bytes(lp.text),
                "top_logprobs": [
                    {"token": text, "logprob": value, "bytes": _token_bytes(text)}
                    for _, text, value in lp.top
                ],
            }
            for lp in items
        ]
    }


def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.text)
    return {
        "tokens": [lp.text for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{text: value for _, text, value in lp.top} for lp in items],
        "text_offset": offsets,
    }


def completion_response(
    parsed: ParsedRequest, rid: str, created: int, t: Transcript
) -> dict[str, Any]:
    """The whole non-streaming body: a `chat.completion` or a `text_completion`."""
    want_logprobs = parsed.job.params.logprobs
    if parsed.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": t.text},
            "logprobs": chat_logprobs(t.logprobs) if want_logprobs else None,
            "finish_reason": t.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": t.text,
            "logprobs": completion_logprobs(t.logprobs, parsed.prompt_chars)
            if want_logprobs
            else None,
            "finish_reason": t.finish_reason,
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": parsed.job.model,
        "choices": [choice],
        "usage": t.usage(),
    }


class ChunkWriter:
    """Builds the SSE chunks of one streaming response, in order."""

    def __init__(self, parsed: ParsedRequest) -> None:
        self.parsed = parsed
        self.id = new_id(parsed.kind)
        self.created = now()
        self.object = "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"
        self._offset = parsed.prompt_chars
        self._want_logprobs = parsed.job.params.logprobs

    def _chunk(self, choice: dict[str, Any] | None) -> bytes:
        doc: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.parsed.job.model,
            "choices": [] if choice is None else [choice],
        }
        if self.parsed.include_usage:
            doc["usage"] = None
        return sse_data(doc)

    def opening(self) -> bytes:
        """Chat streams open with the assistant's role, before any token (as OpenAI's do)."""
        if self.parsed.kind != "chat":
            return b""
        return self._chunk(
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def event(self, event: SequenceEvent, finish_reason: str | None) -> bytes:
        """The chunk(s) for one event: its text and, on the last one, the finish reason."""
        out = b""
        lps = event.logprobs or []
        if event.text or lps:
            if self.parsed.kind == "chat":
                out += self._chunk(
                    {
                        "index": 0,
                        "delta": {"content": event.text},
                        "logprobs": chat_logprobs(lps) if self._want_logprobs else None,
                        "finish_reason": None,
                    }
                )
            else:
                logprobs = completion_logprobs(lps, self._offset) if self._want_logprobs else None
                self._offset += len(event.text)
                return self._chunk(
                    {
                        "index": 0,
                        "text": event.text,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                    }
                )
        if finish_reason is not None:
            if self.parsed.kind == "chat":
                out += self._chunk(
                    {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
                )
            else:
                out += self._chunk(
                    {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
                )
        return out

    def usage(self, t: Transcript) -> bytes:
        doc = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.parsed.job.model,
            "choices": [],
            "usage": t.usage(),
        }
        return sse_data(doc)


SSE_DONE = b"data: [DONE]\n\n"


def sse_data(doc: Any) -> bytes:
    return b"data: " + msgspec.json.encode(doc) + b"\n\n"
