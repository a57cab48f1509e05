"""The one long-lived SIGTERM/SIGINT receiver.

It is opened first, before anything slow, and stays open for the whole process: a signal
that arrives before any receiver is open kills the process outright, and trio restores the
default handler whenever a receiver block exits.

First signal: `begin_drain(signum)` (health says draining, in-flight work finishes, exit 0).
Second signal: stop NOW. Logs are flushed, then the process dies *by that same signal*
(default handler restored, signal re-sent): the exit status is the honest "killed by
SIGTERM" (a shell shows 143, or 130 for SIGINT; Python's subprocess shows -15). It is not 0,
because models were not unloaded and requests were cut; and under systemd, death by SIGTERM
or SIGINT counts as a clean stop, so `Restart=on-failure` does not restart a node the
operator insisted on stopping. Should the re-sent signal not kill (it is blocked or
ignored), the process exits 128 + signum, the shell's convention for the same thing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

import trio

log = logging.getLogger(__name__)

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def flush_logs() -> None:
    """Flush every logging handler, stdout and stderr (before an `os._exit`)."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def die_by_signal(signum: int) -> NoReturn:
    """Exit at once, killed by `signum`; skips finally blocks, atexit and destructors."""
    flush_logs()
    try:
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
    finally:
        os._exit(128 + signum)


class SignalWatcher:
    """Counts SIGTERM/SIGINT; `run` is the actor that holds the receiver open.

    `on_second` is the hard exit (`die_by_signal`); tests pass a recorder.
    """

    def __init__(
        self,
        begin_drain: Callable[[int], object],
        *,
        on_second: Callable[[int], object] = die_by_signal,
    ) -> None:
        self.begin_drain = begin_drain
        self.on_second = on_second
        self.received: list[int] = []

    @property
    def draining(self) -> bool:
        return bool(self.received)

    def handle(self, signum: int) -> None:
        """The decision, without trio: first signal drains, a second exits at once."""
        self.received.append(signum)
        name = signal.Signals(signum).name
        if len(self.received) == 1:
            log.warning("%s: draining (send it again to stop at once)", name)
            self.begin_drain(signum)
        else:
            log.error("second signal (%s) while draining: exiting now, without drain", name)
            self.on_second(signum)

    async def run(
        self, *, task_status: trio.TaskStatus[SignalWatcher] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.open_signal_receiver(*DRAIN_SIGNALS) as signals:
            task_status.started(self)
            async for signum in signals:
                self.handle(signum)
