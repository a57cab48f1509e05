"""Where a model's start-up time goes: seconds per phase of one load, for the daemon's log.

The loader (`loader.load_transformer`), the executor's build and its warm-up each time their
part in one `LoadPhases`; the executor logs its `summary()` once the model is warm, as one
line an operator reads (`start-up phases: 3.41 s: parse 0.40, weights 1.20 (…), …`).

Phases are named by what they do (`parse`, `dequantize`, `pack`, `tables`, `tokenizer`,
`kv pool`, `warm-up`, …); a phase entered twice (each layer's dequantisation) adds up, and the
line keeps the order of first entry. Notes (`weight cache hit, 1.83 GB mapped`) say what a
number means. Seconds are wall-clock (`time.perf_counter`): what the operator waits for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseStatistics:
    """A snapshot of a `LoadPhases`: seconds per phase (in order of first entry), and notes."""

    seconds: tuple[tuple[str, float], ...]
    notes: tuple[str, ...]

    @property
    def total(self) -> float:
        return sum(s for _, s in self.seconds)


class LoadPhases:
    """Seconds spent in each phase of one model's load (thread-safe: a phase may be timed on
    several threads at once, as parallel dequantisation does; their seconds then add up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._notes: list[str] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name` (added to what `name` already took)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def note(self, text: str) -> None:
        """A remark for the log line (e.g. whether the weight cache was hit)."""
        with self._lock:
            self._notes.append(text)

    def statistics(self) -> PhaseStatistics:
        with self._lock:
            return PhaseStatistics(tuple(self._seconds.items()), tuple(self._notes))

    def summary(self) -> str:
        """`3.41 s: parse 0.40, weights 1.20, …; notes` — the phases' seconds, then the notes."""
        stats = self.statistics()
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in stats.seconds)
        line = f"{stats.total:.2f} s: {parts or 'nothing timed'}"
        return f"{line}; {'; '.join(stats.notes)}" if stats.notes else line
