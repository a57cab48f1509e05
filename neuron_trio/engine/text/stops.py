"""Stop strings, cut exactly, across token boundaries (OpenAI semantics).

The text is cut just before the first stop string that appears; the stop string itself is not
returned. Text that could still be the start of a stop string (e.g. "Obs" with the stop
"Observation:") is held back until the next piece shows whether it is one; nothing else waits.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """Feed text pieces with `push`; `flush` at the end returns what was held back.

    After a stop string was seen, `push` returns ("", True) and `flush` returns "".
    Empty stop strings are ignored.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        cut = -1
        for stop in self.stops:
            at = buf.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut, self.matched = at, stop
        if cut != -1:
            self.stopped = True
            self._held = ""
            return buf[:cut], True
        hold = self._partial_tail(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """What was held back, at the end of the text (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper start of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
