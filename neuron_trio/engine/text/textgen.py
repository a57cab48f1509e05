"""One sequence's text pipeline: token ids -> incremental text -> stop strings cut exactly.

The detokenizer never returns half a UTF-8 character; the stop matcher holds back any tail
that may still grow into a stop string, so a stop string split over several tokens is cut
exactly where it begins and never shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from neuron_trio.engine.text.stops import StopMatcher
from neuron_trio.engine.text.tokenizer import IncrementalDetokenizer


class _Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class _StopMatcher(Protocol):
    def push(self, text: str) -> tuple[str, bool]: ...
    def flush(self) -> str: ...


class TextPipeline:
    def __init__(self, detokenizer: _Detokenizer, stops: _StopMatcher):
        self._detok = detokenizer
        self._stops = stops
        self.stopped = False  # a stop string matched: no more text, ever

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        stops: Sequence[str],
        prompt_ids: Sequence[int] = (),
        show_special: Sequence[int] = (),
    ) -> TextPipeline:
        """`show_special`: special tokens whose text is shown (tool-call markers, which the
        tool-call parser must see)."""
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, show_special=show_special)
        return cls(detokenizer, StopMatcher(list(stops)))

    def push(self, token_id: int) -> tuple[str, bool]:
        """Feed one generated token; return (text safe to show now, stop string matched)."""
        if self.stopped:
            return "", True
        emit, stopped = self._stops.push(self._detok.push(token_id))
        self.stopped = stopped
        return emit, stopped

    def finish(self) -> str:
        """The sequence ended without a stop string: whatever text is still held back."""
        if self.stopped:
            return ""
        emit, stopped = self._stops.push(self._detok.flush())
        self.stopped = stopped
        if stopped:
            return emit
        return emit + self._stops.flush()
