"""`/v1/completions` as OpenAI defines it: a list of prompts, each with its `n` choices, and
`echo`.

A request of P prompts becomes P jobs (one per prompt, each with the request's `n`); its
choices are numbered across them as OpenAI does: prompt p's choice j has `index` p·n + j.
`usage` adds up every prompt's tokens. With `echo`, each choice's text starts with its
prompt's text (a prompt of token ids: their text, asked of the node before the batch runs,
`batch_generation.with_echo_texts`); with `echo` and `logprobs`, its logprobs start with the
prompt's tokens, the first one's logprob and alternatives null (nothing precedes it), as
OpenAI's legacy API and vLLM return them (the engine computes them:
`SamplingParams.prompt_logprobs`).
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
    completion_logprobs,
    new_id,
    now,
    sse_data,
)
from neuron_trio.service.api import SequenceEvent, TokenLogprob

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
    # per prompt: the text each of its choices starts with (None: a prompt of token ids whose
    # text is not known yet, `with_echo_texts`)
    echo: tuple[str | None, ...] | None = None

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
    parts = tuple(completion_parsed(req, p) for p in prompts)
    echo = None
    if req.echo:
        echo = tuple(p if isinstance(p, str) else None for p in prompts)
        if req.logprobs is not None:  # the prompt's logprobs before the completion's
            parts = tuple(_with_prompt_logprobs(p) for p in parts)
    return CompletionBatch(parts, echo)


def _with_prompt_logprobs(part: ParsedRequest) -> ParsedRequest:
    params = replace(part.job.params, prompt_logprobs=True)
    return replace(part, job=replace(part.job, params=params))


def echo_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """The prompt's part of a choice's `logprobs`: its tokens from text offset 0, the first
    one's logprob and alternatives null. (Offsets count the tokens' own texts, as vLLM's do:
    a special token's text need not appear in the echoed prompt.)"""
    doc = completion_logprobs(items, 0)
    if items:
        doc["token_logprobs"][0] = None
        doc["top_logprobs"][0] = None
    return doc


def _joined(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    if tail is None:
        return head
    return {key: [*head[key], *tail[key]] for key in head}


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
        for shaper, echo in zip(self._shapers, self.batch.echo or (), strict=False):
            shaper.prompt_chars = len(echo or "")  # the completion's text follows the echo

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
                    choice["text"] = (self.batch.echo[p] or "") + choice["text"]
                    if choice["logprobs"] is not None:
                        head = echo_logprobs(t.choice(j).prompt_logprobs or [])
                        choice["logprobs"] = _joined(head, choice["logprobs"])
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
            logprobs = None
            if self._shapers[part].want_logprobs:
                logprobs = echo_logprobs(event.prompt_logprobs or [])
            echo = {"index": index, "text": self.batch.echo[part] or "", "logprobs": logprobs}
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
