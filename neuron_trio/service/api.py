"""The seam between the HTTP layer and the service layer.

The HTTP layer talks only to a `NodeService`: the daemon builds the real one
(`neuron_trio.service.node.Node`), HTTP tests build a double under `tests/`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry

from neuron_trio.config import ModelConfig
from neuron_trio.executor.api import (
    GOOD_FINISH_REASONS,
    Constraint,
    SamplingParams,
    SequenceEvent,
    TokenLogprob,
    ToolCall,
    ToolFunction,
)
from neuron_trio.service.documents.load_report import LoadReport

__all__ = [
    "GOOD_FINISH_REASONS",
    "ChatMessage",
    "Constraint",
    "GenerationJob",
    "HealthSnapshot",
    "LoadReport",
    "ModelSummary",
    "NodeService",
    "SamplingParams",
    "SequenceEvent",
    "TokenLogprob",
    "TokenizeJob",
    "Tokenized",
    "ToolCall",
    "ToolFunction",
    "template_message",
]

HealthStatus = Literal["starting", "ok", "draining", "recovering", "wedged"]


@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user", "assistant", "tool"]  # "developer" arrives as "system"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call this is the result of
    name: str | None = None  # the participant's (or tool's) name, for templates that show it


def template_message(message: ChatMessage) -> dict[str, Any]:
    """`message` as chat templates read it (transformers' convention: a call's arguments as
    an object, under `tool_calls[i].function`)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


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
    # Prompt prefixes are shared (from the prefix cache) only between jobs with the same salt:
    # the client's cache_salt and, unless prefix_cache_isolation = "none", its tenant's (or
    # its tenant's prefix_cache_group's) name.
    cache_salt: bytes | None = None
    # The tenant's name (http/tenancy.py), None without keys: fair service and its limits.
    tenant: str | None = None
    # More names for the chat template (`chat_template_kwargs`, `reasoning_effort`), bounded
    # by the HTTP layer: a few scalars.
    template_kwargs: tuple[tuple[str, str | int | float | bool | None], ...] = ()


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
    fingerprint: str = ""  # `system_fingerprint`: model file + dtype + engine build


@dataclass(frozen=True)
class TokenizeJob:
    """A `/tokenize` request, validated by the HTTP layer: a text or a chat (one of them)."""

    model: str | None  # None: the node's only model
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None  # rendered as a chat request's would be
    tools: tuple[ToolFunction, ...] = ()
    add_special: bool = True  # a text: BOS where the model wants it (a chat's template decides)
    with_pieces: bool = False  # each token's bytes too
    text_param: str = "prompt"  # the request field `text` came from, for a 400 naming it


@dataclass(frozen=True)
class Tokenized:
    model: str
    ids: tuple[int, ...]
    pieces: tuple[bytes, ...] = ()  # with_pieces: each token's bytes (a special token's text)
    context: int = 0  # the model's context (vLLM's `max_model_len`)


class NodeService(Protocol):
    """What the HTTP layer may ask of the node. Every method is cheap unless it says so."""

    @property
    def draining(self) -> bool: ...

    def health(self) -> HealthSnapshot: ...

    def load(self, model: str | None = None) -> LoadReport:
        """How loaded `model` is (the node as a whole when None or not loaded)."""
        ...

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

    async def tokenize(self, job: TokenizeJob) -> Tokenized:
        """`job`'s token ids as its model's prompt would hold them (service/requests/tokenize.py).

        Raises ModelNotFoundError (404), RequestError (400: no model named while several are
        loaded, a template that refuses the messages, a text far past the context),
        UnavailableError (503) while the model loads or recovers.
        """
        ...

    async def detokenize(self, model: str | None, ids: tuple[int, ...]) -> str:
        """The text of `ids` in `model` (None: the only one), special tokens included; raises
        as `tokenize`, and RequestError (400) naming an id outside the vocabulary."""
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
