"""The `model` object of `GET /v1/models` and `GET /v1/models/{id}`."""

from __future__ import annotations

from typing import Any

from neuron_trio.service.api import ModelSummary

__all__ = ["model_object"]


def model_object(m: ModelSummary) -> dict[str, Any]:
    """OpenAI's model object (`id`, `object`, `created`, `owned_by`) plus `context_length`
    (what vLLM and llama.cpp call it: routers read it to size prompts)."""
    return {
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": "neuron",
        "context_length": m.context,
    }
