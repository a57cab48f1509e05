"""What the speculation tests share: a batch of plain prompts run to the end, and what each
sequence's events say (its tokens, its text)."""

from __future__ import annotations

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.types import SamplingParams, SequenceEvent
from tests.engine.drain import drain


def run_prompts(
    engine: Engine, prompts: list[str], params: SamplingParams
) -> list[list[SequenceEvent]]:
    """Every prompt added (no chat template) and the engine drained: each one's events."""
    ids = [engine.add(engine.encode_prompt(p, chat=False), params, chat=False) for p in prompts]
    events = drain(engine)
    return [events[i] for i in ids]


def tokens_of(events: list[SequenceEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def text_of(events: list[SequenceEvent]) -> str:
    return "".join(e.text for e in events)
