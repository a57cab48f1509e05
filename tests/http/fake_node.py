"""A `NodeService` test double for the HTTP layer: scripted tokens, paced by trio events.

Tests steer it through plain attributes: `status`, `draining`, `enter_error` (raised on
entering `generate`), `fail_at` (UnavailableError instead of event number N), and `gate`
(an async function awaited before event N is produced: pacing with trio events, no sleeps).
It records what the HTTP layer asked: `jobs`, `produced`, `open`, `closed_early`, `exited`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter

from neuron_trio.config import ModelConfig
from neuron_trio.errors import ModelLoadError, ModelNotFoundError, UnavailableError
from neuron_trio.service.api import (
    GenerationJob,
    HealthSnapshot,
    HealthStatus,
    LoadReport,
    ModelSummary,
    SequenceEvent,
    Tokenized,
    TokenizeJob,
    TokenLogprob,
)

DEFAULT_TOKENS = ("Hello", ",", " world", "!")


class FakeNode:
    def __init__(
        self, *, models: tuple[str, ...] = ("fake-model",), tokens: tuple[str, ...] = DEFAULT_TOKENS
    ):
        self.status: HealthStatus = "ok"
        self._draining = False
        self.registry = CollectorRegistry()
        self.node_counter = Counter(
            "fake_node_things", "A collector the node owns.", registry=self.registry
        )
        self.models = {
            name: ModelSummary(name=name, created=1_700_000_000, context=2048) for name in models
        }
        self.tokens = tokens
        self.prompt_tokens = 7
        self.finish_reason = "stop"
        self.enter_error: Exception | None = None
        self.fail_at: int | None = None
        self.gate: Callable[[int], Awaitable[None]] | None = None
        self.load_error: Exception | None = None
        self.jobs: list[GenerationJob] = []
        self.produced = 0  # events yielded, over all requests
        self.open = 0  # generate contexts open now
        self.closed_early = 0  # contexts left before their last event
        self.entered = trio.Event()  # set on every entry (replace it to wait for the next)
        self.exited = trio.Event()  # set on every exit
        self.loaded: list[ModelConfig] = []
        self.unloaded: list[str] = []
        self.next_seq = 0
        # when set: the events every request gets, as they are (seq_id aside)
        self.script: list[SequenceEvent] | None = None
        # what `load` answers: per model, else the node's; and what it was asked
        self.node_load = LoadReport(
            num_requests_waiting=0, num_requests_running=0, kv_cache_usage_perc=0.0,
            application_utilization=0.0,
        )  # fmt: skip
        self.loads: dict[str, LoadReport] = {}
        self.load_asked: list[str | None] = []
        self.tokenize_jobs: list[TokenizeJob] = []

    # --- NodeService ----------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value

    def health(self) -> HealthSnapshot:
        return HealthSnapshot(
            status=self.status,
            boot_id="b00t",
            started_at="2026-01-01T00:00:00Z",
            starts=3,
            detail={"models": len(self.models)},
        )

    def load(self, model: str | None = None) -> LoadReport:
        self.load_asked.append(model)
        return self.loads.get(model, self.node_load) if model is not None else self.node_load

    async def node_info(self) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        return {
            "hostname": "fake-host",
            "boot_id": "b00t",
            "gpus": [],
            "models": [{"name": m, "state": "ready"} for m in self.models],
        }

    def list_models(self) -> list[ModelSummary]:
        return list(self.models.values())

    @asynccontextmanager
    async def generate(self, job: GenerationJob) -> AsyncIterator[AsyncIterator[SequenceEvent]]:
        await trio.lowlevel.checkpoint()
        if job.model not in self.models:
            raise ModelNotFoundError(job.model)
        if self.enter_error is not None:
            raise self.enter_error
        self.jobs.append(job)
        self.next_seq += 1
        state = {"done": False}
        self.open += 1
        self.entered.set()
        try:
            yield self._events(job, self.next_seq, state)
        finally:
            self.open -= 1
            if not state["done"]:
                self.closed_early += 1
            self.exited.set()

    async def _events(
        self, job: GenerationJob, seq_id: int, state: dict[str, bool]
    ) -> AsyncIterator[SequenceEvent]:
        if self.script is not None:
            for event in self.script:
                await trio.lowlevel.checkpoint()
                yield replace(event, seq_id=seq_id)
            state["done"] = True
            return
        # no max_tokens (a chat): to the end of the fake's "context", its tokens
        limit = job.params.max_tokens or len(self.tokens)
        count = min(len(self.tokens), limit)
        reason = "length" if limit < len(self.tokens) else self.finish_reason
        for i in range(count):
            if self.gate is not None:
                await self.gate(i)
            else:
                await trio.lowlevel.checkpoint()
            if self.fail_at == i:
                state["done"] = True
                raise UnavailableError("model fake-model is wedged", code="wedged")
            text = self.tokens[i]
            last = i == count - 1
            logprobs = None
            if job.params.logprobs:
                top = tuple((100 + k, f"alt{k}", -1.0 - k) for k in range(job.params.top_logprobs))
                logprobs = [TokenLogprob(token_id=i, text=text, logprob=-0.5, top=top)]
            self.produced += 1
            if last:
                state["done"] = True
            yield SequenceEvent(
                seq_id=seq_id,
                text=text,
                token_ids=[i],
                logprobs=logprobs,
                finish_reason=reason if last else None,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=i + 1,
                prompt_logprobs=self._prompt_logprobs(job) if i == 0 else None,
            )

    @staticmethod
    def _prompt_logprobs(job: GenerationJob) -> list[TokenLogprob] | None:
        """With params.prompt_logprobs: a token a character (its code point), logprob -1."""
        if not job.params.prompt_logprobs:
            return None
        ids = job.prompt_ids or tuple(ord(c) for c in job.prompt or "")
        top = job.params.top_logprobs
        return [
            TokenLogprob(
                t, chr(t), 0.0 if k == 0 else -1.0, () if k == 0 else ((t, chr(t), -1.0),) * top
            )
            for k, t in enumerate(ids)
        ]

    async def tokenize(self, job: TokenizeJob) -> Tokenized:
        """One token a character (its code point), the chat's messages' texts joined."""
        await trio.lowlevel.checkpoint()
        model = self._model_of(job.model)
        self.tokenize_jobs.append(job)
        text = job.text or "".join(m.content for m in job.messages or ())
        ids = tuple(ord(c) for c in text)
        pieces = tuple(c.encode() for c in text) if job.with_pieces else ()
        return Tokenized(model=model, ids=ids, pieces=pieces, context=self.models[model].context)

    async def detokenize(self, model: str | None, ids: tuple[int, ...]) -> str:
        await trio.lowlevel.checkpoint()
        self._model_of(model)
        return "".join(chr(i) for i in ids)

    def _model_of(self, model: str | None) -> str:
        if model is None and len(self.models) == 1:
            return next(iter(self.models))
        if model is None or model not in self.models:
            raise ModelNotFoundError(str(model))
        return model

    async def load_model(self, spec: ModelConfig) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        if self.load_error is not None:
            raise self.load_error
        if spec.source == "bad:":
            raise ModelLoadError("cannot read bad:")
        self.loaded.append(spec)
        self.models[spec.name] = ModelSummary(
            name=spec.name, created=1_700_000_001, context=spec.context
        )
        return {"name": spec.name, "state": "ready"}

    async def unload_model(self, name: str) -> None:
        await trio.lowlevel.checkpoint()
        if name not in self.models:
            raise ModelNotFoundError(name)
        del self.models[name]
        self.unloaded.append(name)

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self.registry
