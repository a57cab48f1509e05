"""Threads for the communicator and tensor-parallel tests, ordered by events, never by sleeps:
`SignallingFailpoints` sets `reached[name]` as a failpoint is entered, and `Worker` runs a
function on a daemon thread, joined within `TIMEOUT` so a bug fails instead of hanging."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

from neuron_trio import failpoints as fp

TIMEOUT = 30.0


class SignallingFailpoints(fp.Failpoints):
    """Failpoints that set `reached[name]` as a failpoint is entered."""

    def __init__(self, spec: str) -> None:
        super().__init__(fp.parse(spec))
        self.arm()
        self.reached: defaultdict[str, threading.Event] = defaultdict(threading.Event)

    def reach(self, name: str, *, until: threading.Event | None = None) -> None:
        self.reached[name].set()
        super().reach(name, until=until)


class Worker:
    """Runs `fn` on a daemon thread and records its result or exception."""

    def __init__(self, fn: Callable[[], object], name: str) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def join(self) -> None:
        assert self.done.wait(TIMEOUT), f"{self.thread.name} did not finish"
