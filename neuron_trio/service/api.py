"""The seam between the HTTP layer and the service layer.

The HTTP layer talks only to a `NodeService`: the daemon builds the real one
(`neuron_trio.service.node.Node`), HTTP tests build a double under `tests/`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry

from neuron_trio.config import ModelConfig
from neuron_trio.engine.types import SamplingParams, SequenceEvent, TokenLogprob

__all__ = [
    "ChatMessage",
    "GenerationJob",
    "HealthSnapshot",
    "ModelSummary",
    "NodeService",
    "SamplingParams",
    "SequenceEvent",
    "TokenLogprob",
]

HealthStatus = Literal["starting", "ok", "draining", "recovering", "wedged"]


@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user", "assistant"]  # "developer" arrives here as "system"
    content: str


@dataclass(frozen=True)
class GenerationJob:
    """One completion request, already validated by the HTTP layer.

    Exactly one of `prompt` (raw completion), `prompt_ids` (raw completion given as token
    ids, used as they are) and `messages` (chat, rendered with the model's chat template)
    is set.
    """

    model: str
    params: SamplingParams
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class HealthSnapshot:
    status: HealthStatus
    boot_id: str
    started_at: str  # RFC 3339 UTC
    starts: int
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSummary:
    name: str
    created: int  # unix seconds, when it was loaded
    context: int


class NodeService(Protocol):
    """What the HTTP layer may ask of the node. Every method is cheap unless it says so."""

    @property
    def draining(self) -> bool: ...

    def health(self) -> HealthSnapshot: ...

    async def node_info(self) -> dict[str, Any]:
        """The `/v1/node` document (live GPU reads: may take up to the NVML timeout)."""
        ...

    def list_models(self) -> list[ModelSummary]: ...

    def generate(
        self, job: GenerationJob
    ) -> AbstractAsyncContextManager[AsyncIterator[SequenceEvent]]:
        """Queue `job` on its model; iterate the context's value for its events.

        Raises on entering (before any event): ModelNotFoundError (404), RequestError or
        ContextLengthError (400), QueueFullError (429), UnavailableError (503: draining,
        recovering, wedged). Raises UnavailableError while iterating if the model wedges.
        Leaving the context early (client gone) cancels the sequence at the next step.
        """
        ...

    async def load_model(self, spec: ModelConfig) -> dict[str, Any]:
        """Load a model at run time (slow: reads and places weights). Raises ModelLoadError."""
        ...

    async def unload_model(self, name: str) -> None:
        """Wait for the model's in-flight requests, then free it. Raises ModelNotFoundError."""
        ...

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The node's Prometheus registry; the HTTP layer adds its own collectors to it."""
        ...
