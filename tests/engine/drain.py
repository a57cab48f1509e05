"""Run an engine's steps until it has no work: what the engine tests read back."""

from __future__ import annotations

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.types import SequenceEvent


def drain(engine: Engine) -> dict[int, list[SequenceEvent]]:
    """Step `engine` until it has no work; every event, by request id, in order."""
    events: dict[int, list[SequenceEvent]] = {}
    while engine.has_work:
        for event in engine.step():
            events.setdefault(event.seq_id, []).append(event)
    return events
