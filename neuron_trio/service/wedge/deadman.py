"""The deadman: forensics, then exit 70 at once. One per process, shared by every model.

Why it exists (docs/DESIGN.md): a wedged process that never exits is invisible to systemd. Once
the deadman fires nothing is drained and no destructor runs: draining cannot work while a
collective is stuck, and waiting would only add minutes before systemd restarts us.

The order is: set `firing` (so `/health` says `wedged` from this instant on), gather the
report (every part bounded), write `state_dir/forensics/<utc>.json` atomically, write the
report to stderr as ONE line of JSON (a single `write(2)`), log a one-line summary, flush
the logging handlers, stderr and stdout, then `exit_fn(70)` (`os._exit`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import trio

from neuron_trio.errors import EX_SOFTWARE
from neuron_trio.service.documents.timefmt import utc_iso
from neuron_trio.service.wedge import forensics

log = logging.getLogger("neuron.deadman")

ContextFn = Callable[[], dict[str, Any]]


class DeadmanExit(BaseException):
    """Raised by `Deadman.fire` if its `exit_fn` returned (only a test's fake does).

    A BaseException, so that no `except Exception` on the way up can carry on as if the
    process were still healthy.
    """

    def __init__(self, code: int, report: dict[str, Any], path: Path | None) -> None:
        super().__init__(f"deadman fired: exit {code}")
        self.code = code
        self.report = report
        self.path = path


class Deadman:
    """Writes the forensics report and ends the process with exit 70.

    `context_fn()` (optional, called once while firing, bounded like every other part)
    returns node-wide context: its `"inflight"` list (dicts with at least the request id,
    model and `age_s`) goes to the report's `inflight`; anything else goes under `context`.
    """

    def __init__(
        self,
        state_dir: str | Path,
        *,
        context_fn: ContextFn | None = None,
        exit_fn: Callable[[int], Any] = os._exit,
        logger: logging.Logger | None = None,
        nvidia_smi_timeout_s: float = 5.0,
        part_timeout_s: float = 5.0,
        gather_timeout_s: float = 20.0,
        stderr_fd: int = 2,
    ) -> None:
        self.state_dir = Path(state_dir)
        self._context_fn = context_fn
        self._exit_fn = exit_fn
        self._log = logger or log
        self._nvidia_smi_timeout_s = nvidia_smi_timeout_s
        self._part_timeout_s = part_timeout_s
        self._gather_timeout_s = gather_timeout_s
        self._stderr_fd = stderr_fd
        self._lock = threading.Lock()
        self._firing = threading.Event()
        self._limiter = trio.CapacityLimiter(1)
        self.reason: str | None = None

    @property
    def firing(self) -> bool:
        """True from the first instant the deadman fires: `/health` reports `wedged`."""
        return self._firing.is_set()

    async def fire(
        self,
        reason: str,
        *,
        what: str,
        since: float | None,
        deadlines_s: dict[str, float] | None = None,
        comms: Iterable[Any] = (),
        inflight_at_wedge: list[Any] | None = None,
        details: dict[str, Any] | None = None,
    ) -> NoReturn:
        """Fire from trio: gather on a worker thread (the event loop keeps answering `/health`
        with `wedged` meanwhile), then exit 70. `since` is wall-clock (time.time()).

        Cancellation handling: the gathering thread is abandoned if this task is cancelled,
        and the exit happens anyway (shielded): once fired, the process ends.
        """
        self._mark(reason)
        fired = _Firing(reason, what, since, deadlines_s, list(comms), inflight_at_wedge, details)
        report: forensics.ForensicsReport | None = None
        with trio.CancelScope(shield=True), trio.move_on_after(self._gather_timeout_s):
            report = await trio.to_thread.run_sync(
                lambda: self._gather(fired),
                abandon_on_cancel=True,
                thread_name="neuron-deadman",
                limiter=self._limiter,
            )
        if report is None:
            report = self._minimal(fired, f"gathering overran {self._gather_timeout_s:g} s")
        self._finish(report)

    # --- inside ---------------------------------------------------------------------------

    def _mark(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
        self._firing.set()
        self._log.critical("deadman firing: %s; gathering forensics, then exit 70", reason)

    def _context(self) -> dict[str, Any]:
        if self._context_fn is None:
            return {}
        try:
            ctx = forensics.bounded(
                self._context_fn, self._part_timeout_s, name="forensics-context"
            )
        except Exception as exc:
            return {"context_error": f"{type(exc).__name__}: {exc}"}
        return dict(ctx) if isinstance(ctx, dict) else {"context": ctx}

    def _gather(self, fired: _Firing) -> forensics.ForensicsReport:
        ctx = self._context()
        inflight = ctx.pop("inflight", [])
        extra = dict(fired.details or {})
        if ctx:
            extra["context"] = ctx
        report = forensics.gather_forensics(
            what=fired.what,
            since=fired.since,
            deadline_s=fired.deadlines_s,
            inflight=inflight if isinstance(inflight, list) else [{"unreadable": repr(inflight)}],
            comms=fired.comms,
            nvidia_smi_timeout_s=self._nvidia_smi_timeout_s,
            part_timeout_s=self._part_timeout_s,
            reason=fired.reason,
            extra=extra,
        )
        if fired.inflight_at_wedge is not None:
            report.inflight_at_wedge = fired.inflight_at_wedge
        return report

    def _minimal(self, fired: _Firing, gather_error: str) -> forensics.ForensicsReport:
        """What can be said without the bounded parts: gathering failed or overran."""
        threads: list[forensics.ThreadStack] | dict[str, str]
        try:
            threads = forensics.thread_stacks()
        except Exception as exc:
            threads = {"error": repr(exc)}
        return forensics.ForensicsReport(
            reason=fired.reason,
            what=fired.what,
            since=utc_iso(fired.since) if fired.since is not None else None,
            deadlines_s=fired.deadlines_s,
            pid=os.getpid(),
            extra=fired.details or {},
            threads=threads,
            gather_error=gather_error,
        )

    def _finish(self, report: forensics.ForensicsReport) -> NoReturn:
        report.exit_code = EX_SOFTWARE
        path: Path | None = None
        try:
            path = forensics.write_report(self.state_dir, report)
            report.written_to = str(path)
        except Exception as exc:
            report.write_error = f"{type(exc).__name__}: {exc}"
        document: dict[str, Any] = msgspec.to_builtins(report, enc_hook=repr)
        line = forensics.to_json({"event": "neuron.deadman", "level": "CRITICAL", **document})
        try:
            os.write(self._stderr_fd, (line + "\n").encode("utf-8", "replace"))
        except OSError:
            pass
        self._log.critical(
            "deadman: exit %d (%s: %s wedged); forensics %s",
            EX_SOFTWARE,
            report.reason,
            report.what,
            path if path is not None else f"not written ({report.write_error})",
        )
        _flush_everything()
        self._exit_fn(EX_SOFTWARE)
        raise DeadmanExit(EX_SOFTWARE, document, path)


@dataclass(frozen=True)
class _Firing:
    """What `fire` was told: why, what wedged and since when, the deadlines, the
    communicators to ask, the requests in flight at the wedge, anything else to report."""

    reason: str
    what: str
    since: float | None  # wall clock
    deadlines_s: dict[str, float] | None
    comms: list[Any]
    inflight_at_wedge: list[Any] | None
    details: dict[str, Any] | None


def _flush_everything() -> None:
    """os._exit skips every buffer: flush logging handlers, then stderr and stdout."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            try:
                handler.flush()
            except Exception:
                pass
    for stream in (sys.stderr, sys.stdout):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
