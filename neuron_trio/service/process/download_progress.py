"""Download progress for systemd: STATUS= in bytes and percent, with EXTEND_TIMEOUT_USEC=.

A default model may have to be downloaded before neuron is ready, and a big one takes longer
than any fixed start timeout. While bytes arrive, every report (at most one a second) asks
systemd for `silence_s` more (`EXTEND_TIMEOUT_USEC`), so a start only times out once the
download stops moving for that long (and TimeoutStartSec= has passed): the timeout bounds
silence, not the size of the model.

`DownloadProgress` is called on the download's worker thread (huggingface_hub's progress
bar calls it); the notifier's send is thread-safe and never blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

ByteProgress = Callable[[int, int | None], None]  # (bytes so far, total or None if unknown)

LOAD_SILENCE_S = 300.0  # a start may go this long without progress (past TimeoutStartSec=)
REPORT_EVERY_S = 1.0


class TimeoutSink(Protocol):
    """What this needs of `service.process.notifier.Notifier`."""

    def extend_timeout(self, seconds: float, status: str | None = None) -> Any: ...


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def describe(what: str, done: int, total: int | None) -> str:
    """'downloading X: 1.5 GiB of 4.0 GiB (37%)', or without the total when it is unknown."""
    if total:
        return f"downloading {what}: {_size(done)} of {_size(total)} ({100 * done // total}%)"
    return f"downloading {what}: {_size(done)}"


class DownloadProgress:
    """A `ByteProgress` that reports to systemd at most every `every_s` (and at the end)."""

    def __init__(
        self,
        sink: TimeoutSink,
        what: str,
        *,
        silence_s: float = LOAD_SILENCE_S,
        every_s: float = REPORT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self.what = what
        self.silence_s = silence_s
        self.every_s = every_s
        self.clock = clock
        self._last: float | None = None

    def __call__(self, done: int, total: int | None) -> None:
        now = self.clock()
        finished = total is not None and done >= total
        if self._last is not None and now - self._last < self.every_s and not finished:
            return
        self._last = now
        self.sink.extend_timeout(self.silence_s, describe(self.what, done, total))


def reporting_tqdm(on_bytes: ByteProgress, *, quiet: bool) -> type[Any]:
    """A tqdm class for huggingface_hub's `tqdm_class=` that passes byte counts to `on_bytes`
    (and draws nothing when `quiet`)."""
    from tqdm import tqdm

    class _Reporting(tqdm):  # type: ignore[misc,type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if quiet:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self._done = int(kwargs.get("initial") or 0)
            self._total = kwargs.get("total")
            on_bytes(self._done, self._total)

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            on_bytes(self._done, self._total)
            return super().update(n)  # type: ignore[no-any-return]

    return _Reporting
