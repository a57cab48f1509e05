"""OpenAI responses: the JSON body of a completion, its SSE chunks, and the error shape.

Each request kind has one shaper (`ChatShaper`, `CompletionShaper`) that knows its choice
and chunk documents; `Transcript` collects what the engine's events said, and `ChunkWriter`
frames a shaper's chunks as server-sent events.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from neuron_trio.http.openai.requests import ParsedRequest, RequestKind
from neuron_trio.service.api import GOOD_FINISH_REASONS, SequenceEvent, TokenLogprob, ToolCall

__all__ = [
    "SSE_DONE",
    "ChatShaper",
    "ChoiceTranscript",
    "ChunkWriter",
    "CompletionShaper",
    "Transcript",
    "completion_response",
    "error_body",
    "new_id",
    "now",
    "shaper_for",
    "sse_data",
]


def error_body(
    message: str,
    *,
    error_type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """The one error shape of every non-2xx response and of a mid-stream SSE error event."""
    return {"error": {"message": message, "type": error_type, "code": code, "param": param}}


@dataclass
class ChoiceTranscript:
    """What the events of one choice said."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # completions' echo with logprobs
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None
    reasoning_parts: list[str] = field(default_factory=list)  # a thinking model's thinking

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)


@dataclass
class Transcript:
    """Everything one request's events said (each of its n choices), for the response body
    and the usage (which counts the tokens of every choice)."""

    choices: dict[int, ChoiceTranscript] = field(default_factory=dict)
    prompt_tokens: int = 0

    def add(self, event: SequenceEvent) -> None:
        choice = self.choices.setdefault(event.index, ChoiceTranscript())
        if event.text:
            choice.text_parts.append(event.text)
        if event.reasoning:
            choice.reasoning_parts.append(event.reasoning)
        if event.logprobs:
            choice.logprobs.extend(event.logprobs)
        if event.tool_calls:
            choice.tool_calls.extend(event.tool_calls)
        if event.prompt_logprobs is not None:
            choice.prompt_logprobs = event.prompt_logprobs
        if event.prompt_tokens:
            self.prompt_tokens = event.prompt_tokens
        if event.completion_tokens:
            choice.completion_tokens = event.completion_tokens
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            choice.error = event.error

    def choice(self, index: int) -> ChoiceTranscript:
        return self.choices.get(index) or ChoiceTranscript()

    @property
    def finish_reason(self) -> str | None:
        """The request's: the first abnormal one of a choice (cancelled, error), else the
        first choice's once every choice has finished."""
        reasons = [c.finish_reason for _, c in sorted(self.choices.items())]
        abnormal = [r for r in reasons if r is not None and r not in GOOD_FINISH_REASONS]
        if abnormal:
            return abnormal[0]
        if reasons and all(r is not None for r in reasons):
            return reasons[0]
        return None

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices.values() if c.error), None)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices.values())

    @property
    def text(self) -> str:
        """Choice 0's text."""
        return self.choice(0).text

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def new_id(kind: RequestKind) -> str:
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


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class ChatShaper:
    """`chat.completion` bodies and `chat.completion.chunk` deltas."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, parsed: ParsedRequest) -> None:
        self.want_logprobs = parsed.job.params.logprobs
        self.n = parsed.job.params.n
        self._calls_sent: dict[int, int] = {}  # streaming: tool calls sent per choice

    def choice(self, index: int, t: ChoiceTranscript) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": t.text}
        if t.tool_calls:
            # as OpenAI: the calls, and content only if the model also wrote some
            message["content"] = t.text.strip() or None
            message["tool_calls"] = [_tool_call(c) for c in t.tool_calls]
        if t.reasoning:  # vLLM's and llama.cpp's field for a thinking model's thinking
            message["reasoning_content"] = t.reasoning
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(t.logprobs) if self.want_logprobs else None,
            "finish_reason": t.finish_reason,
        }

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role, before any token (as OpenAI's do)."""
        delta = {"role": "assistant", "content": ""}
        return [
            {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
            for i in range(self.n)
        ]

    def chunks(self, event: SequenceEvent, finish_reason: str | None) -> list[dict[str, Any]]:
        """The chunk choices for one event: its text, its tool calls (each as OpenAI streams
        one: id and name first, then the arguments), then (on the last) the finish reason."""
        out = []
        i = event.index
        lps = event.logprobs or []
        if event.reasoning:
            delta = {"reasoning_content": event.reasoning}
            out.append({"index": i, "delta": delta, "logprobs": None, "finish_reason": None})
        if event.text or lps:
            logprobs = chat_logprobs(lps) if self.want_logprobs else None
            content = {"content": event.text}
            out.append({"index": i, "delta": content, "logprobs": logprobs, "finish_reason": None})
        for call in event.tool_calls or ():
            k = self._calls_sent.get(i, 0)
            self._calls_sent[i] = k + 1
            head = {
                "index": k,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            args = {"index": k, "function": {"arguments": call.arguments}}
            for part in (head, args):
                out.append(
                    {
                        "index": i,
                        "delta": {"tool_calls": [part]},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
        if finish_reason is not None:
            out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish_reason})
        return out


class CompletionShaper:
    """`text_completion` bodies and chunks; logprob text offsets count from the prompt's end."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, parsed: ParsedRequest) -> None:
        self.want_logprobs = parsed.job.params.logprobs
        self.prompt_chars = parsed.prompt_chars
        # streaming: where each choice's next chunk's text starts
        self._offsets: dict[int, int] = {}

    def choice(self, index: int, t: ChoiceTranscript) -> dict[str, Any]:
        logprobs = completion_logprobs(t.logprobs, self.prompt_chars)
        return {
            "index": index,
            "text": t.text,
            "logprobs": logprobs if self.want_logprobs else None,
            "finish_reason": t.finish_reason,
        }

    def opening(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, event: SequenceEvent, finish_reason: str | None) -> list[dict[str, Any]]:
        lps = event.logprobs or []
        offset = self._offsets.get(event.index, self.prompt_chars)
        if event.text or lps:
            logprobs = completion_logprobs(lps, offset) if self.want_logprobs else None
        elif finish_reason is not None:
            logprobs = None
        else:
            return []
        self._offsets[event.index] = offset + len(event.text)
        choice = {"text": event.text, "logprobs": logprobs, "finish_reason": finish_reason}
        return [{"index": event.index, **choice}]


Shaper = ChatShaper | CompletionShaper


def shaper_for(parsed: ParsedRequest) -> Shaper:
    return ChatShaper(parsed) if parsed.kind == "chat" else CompletionShaper(parsed)


def completion_response(
    parsed: ParsedRequest, rid: str, created: int, t: Transcript
) -> dict[str, Any]:
    """The whole non-streaming body: a `chat.completion` or a `text_completion`."""
    shaper = shaper_for(parsed)
    return {
        "id": rid,
        "object": shaper.object,
        "created": created,
        "model": parsed.job.model,
        "system_fingerprint": parsed.system_fingerprint,
        "choices": [shaper.choice(i, t.choice(i)) for i in range(parsed.job.params.n)],
        "usage": t.usage(),
    }


class ChunkWriter:
    """Builds the SSE chunks of one streaming response, in order."""

    def __init__(self, parsed: ParsedRequest) -> None:
        self.parsed = parsed
        self.shaper = shaper_for(parsed)
        self.id = new_id(parsed.kind)
        self.created = now()

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        doc: dict[str, Any] = {
            "id": self.id,
            "object": self.shaper.chunk_object,
            "created": self.created,
            "model": self.parsed.job.model,
            "system_fingerprint": self.parsed.system_fingerprint,
            "choices": choices,
        }
        if self.parsed.include_usage:
            doc["usage"] = None
        return sse_data(doc)

    def opening(self) -> bytes:
        return b"".join(self._chunk([c]) for c in self.shaper.opening())

    def event(self, event: SequenceEvent, finish_reason: str | None) -> bytes:
        """The chunk(s) for one event: its text and, on the last one, the finish reason."""
        return b"".join(self._chunk([c]) for c in self.shaper.chunks(event, finish_reason))

    def usage(self, t: Transcript) -> bytes:
        doc = {
            "id": self.id,
            "object": self.shaper.chunk_object,
            "created": self.created,
            "model": self.parsed.job.model,
            "system_fingerprint": self.parsed.system_fingerprint,
            "choices": [],
            "usage": t.usage(),
        }
        return sse_data(doc)


SSE_DONE = b"data: [DONE]\n\n"


def sse_data(doc: Any) -> bytes:
    return b"data: " + msgspec.json.encode(doc) + b"\n\n"
