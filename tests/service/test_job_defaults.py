"""A chat without max_tokens: the model's configured default, cut to the room the context
leaves, or (no default) None, which the engine runs to the end of the context."""

from __future__ import annotations

from neuron_trio.config import ModelConfig
from neuron_trio.service.api import GenerationJob, SamplingParams, with_default_max_tokens


def _job(max_tokens: int | None) -> GenerationJob:
    return GenerationJob(model="m", params=SamplingParams(max_tokens=max_tokens), messages=())


def test_default_max_tokens_applies_only_where_the_client_gave_none() -> None:
    # `room`: what the engine leaves an answer after the prompt (ServingEngine.answer_room)
    assert with_default_max_tokens(_job(None), 300, room=900).params.max_tokens == 300
    assert with_default_max_tokens(_job(None), 300, room=100).params.max_tokens == 100
    assert with_default_max_tokens(_job(7), 300, room=900).params.max_tokens == 7
    assert ModelConfig(name="m", source="builtin:x").default_max_tokens == 0
    assert with_default_max_tokens(_job(None), 0, room=900).params.max_tokens is None
