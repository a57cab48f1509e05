"""`/v1/completions` as OpenAI defines it: a list of prompts, each with its `n` choices, and
`echo`.

A request of P prompts becomes P jobs (one per prompt, each with the request's `n`); its
choices are numbered across them as OpenAI does: prompt p's choice j has `index` p·n + j.
`usage` adds up every prompt's tokens. With `echo`, each choice's text starts with its
prompt's text (a text prompt only: the HTTP layer does not hold a tokenizer to turn token
ids back into text, so echo with token ids is a 400 naming it); echo with `logprobs` would
need the prompt's logprobs, which the engine does not compute: a 400 naming it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from neuron_trio.errors import RequestError
from neuron_trio.http.openai.requests import (
    ParsedRequest,
    completion_parsed,
    completion_prompts,
    decode_completion_request,
)
from neuron_trio.http.openai.responses import (
    CompletionShaper,
    Transcript,
    new_id,
    now,
    sse_data,
)
from neuron_trio.service.api import SequenceEvent

__all__ = [
    "MAX_CHOICES",
    "MAX_PROMPTS",
    "BatchWriter",
    "CompletionBatch",
    "parse_completion_batch",
]

# Every prompt is a request in the model's queue (`server.max_queue`, default 64): a batch
# must not fill it alone. 16 is the most `n` (8) times two prompts, or 16 prompts of one.
MAX_PROMPTS = 16
MAX_CHOICES = 16  # n × prompts


@dataclass(frozen=True)
class CompletionBatch:
    """A validated `/v1/completions` request: one `ParsedRequest` per prompt."""

    parts: tuple[ParsedRequest, ...]
    echo: tuple[str, ...] | None = None  # per prompt: the text each of its choices starts with

    @property
    def first(self) -> ParsedRequest:
        return self.parts[0]

    @property
    def n(self) -> int:
        return self.first.job.params.n

    def with_fingerprint(self, fingerprint: str | None) -> CompletionBatch:
        parts = tuple(replace(p, system_fingerprint=fingerprint) for p in self.parts)
        return replace(self, parts=parts)


def parse_completion_batch(body: bytes) -> CompletionBatch:
    """Validate a `/v1/completions` body; RequestError (400) names the offending field."""
    req = decode_completion_request(body)
    prompts = completion_prompts(req.prompt)
    n = req.n or 1
    if len(prompts) > MAX_PROMPTS or len(prompts) * n > MAX_CHOICES:
        raise RequestError(
            f"prompt: {len(prompts)} prompts × n = {n}; at most {MAX_PROMPTS} prompts and "
            f"{MAX_CHOICES} choices (prompts × n) in one request",
            param="prompt",
            code="too_many_prompts",
        )
    echo = None
    if req.echo:
        if req.logprobs is not None:
            raise RequestError(
                "echo: not supported together with logprobs (neuron does not compute the "
                "prompt's logprobs)",
                param="echo",
                code="unsupported_value",
            )
        if not all(isinstance(p, str) for p in prompts):
            raise RequestError(
                "echo: supported for text prompts only, not for token ids",
                param="echo",
                code="unsupported_value",
            )
        echo = tuple(p for p in prompts if isinstance(p, str))
    return CompletionBatch(tuple(completion_parsed(req, p) for p in prompts), echo)


@dataclass
class BatchWriter:
    """The body, or the SSE chunks, of a batch's `text_completion` response."""

    batch: CompletionBatch
    id: str = field(default_factory=lambda: new_id("completion"))
    created: int = field(default_factory=now)
    _shapers: list[CompletionShaper] = field(init=False)
    _echoed: set[int] = field(init=False, default_factory=set)  # streaming: choices echoed

    def __post_init__(self) -> None:
        self._shapers = [CompletionShaper(p) for p in self.batch.parts]

    def _index(self, part: int, choice: int) -> int:
        return part * self.batch.n + choice

    def _doc(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        first = self.batch.first
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": first.job.model,
            "system_fingerprint": first.system_fingerprint,
            "choices": choices,
        }

    def body(self, transcripts: list[Transcript]) -> dict[str, Any]:
        """The whole non-streaming response."""
        choices = []
        for p, (shaper, t) in enumerate(zip(self._shapers, transcripts, strict=True)):
            for j in range(self.batch.n):
                choice = shaper.choice(j, t.choice(j))
                choice["index"] = self._index(p, j)
                if self.batch.echo is not None:
                    choice["text"] = self.batch.echo[p] + choice["text"]
                choices.append(choice)
        doc = self._doc(choices)
        doc["usage"] = usage(transcripts)
        return doc

    def chunks(self, part: int, event: SequenceEvent, finish_reason: str | None) -> bytes:
        """The SSE chunks of one event of prompt `part`: its echo first, once per choice."""
        out = []
        index = self._index(part, event.index)
        if self.batch.echo is not None and index not in self._echoed:
            self._echoed.add(index)
            echo = {"index": index, "text": self.batch.echo[part], "logprobs": None}
            out.append({**echo, "finish_reason": None})
        for choice in self._shapers[part].chunks(event, finish_reason):
            out.append({**choice, "index": index})
        return b"".join(self._chunk(c) for c in out)

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        doc = self._doc([choice])
        if self.batch.first.include_usage:
            doc["usage"] = None
        return sse_data(doc)

    def usage_chunk(self, transcripts: list[Transcript]) -> bytes:
        doc = self._doc([])
        doc["usage"] = usage(transcripts)
        return sse_data(doc)


def usage(transcripts: list[Transcript]) -> dict[str, int]:
    prompt = sum(t.prompt_tokens for t in transcripts)
    completion = sum(t.completion_tokens for t in transcripts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
