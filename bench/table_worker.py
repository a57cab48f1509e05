"""The line protocol between bench_table.py and its measuring processes (one per engine), so
that each engine runs in a process of its own (its own RSS, its own interpreter) while the
parent interleaves their runs.

Standard library only: the llama.cpp side imports this under the peer venv's Python.

Worker side: `serve(handlers, ready)` writes one JSON line `{"ready": …}`, then answers each
request line `{"op": NAME, …}` with `{"ok": true, …handler's result}` or `{"ok": false,
"error": …}`, until stdin closes. The protocol keeps the process's original stdout to itself
and points file descriptor 1 at stderr, so whatever a library prints cannot corrupt it.

Parent side: `Worker` starts the process (stdout a pipe, stderr to a log file), `wait_ready`
times the first line from just before the spawn, `call` sends a request and waits for its
answer with a deadline.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


class WorkerError(RuntimeError):
    """Raised by `Worker` if the process exits, answers with an error, or misses a deadline;
    the message carries the tail of its log."""


def serve(
    handlers: Mapping[str, Callable[..., Mapping[str, Any]]], ready: Mapping[str, Any]
) -> None:
    """Answer requests on stdin until it closes (worker side; see the module docstring)."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(message: Mapping[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    send({"ready": True, **ready})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.pop("op", None)
        handler = handlers.get(op)
        if handler is None:
            send({"ok": False, "error": f"unknown op {op!r}"})
            continue
        try:
            send({"ok": True, **handler(**request)})
        except Exception as exc:  # reported to the parent, which records the side as failed
            traceback.print_exc()
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


class Worker:
    """One measuring process (parent side)."""

    def __init__(
        self, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        self.started = time.perf_counter()
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=dict(env) if env is not None else None,
                text=True,
                bufsize=1,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _read(self, timeout_s: float) -> dict[str, Any]:
        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], timeout_s)
        if not ready:
            raise WorkerError(f"no answer within {timeout_s:g} s:\n{self.log_tail()}")
        line = stdout.readline()
        if not line:
            code = self.process.wait()
            raise WorkerError(f"the worker exited {code}:\n{self.log_tail()}")
        message: dict[str, Any] = json.loads(line)
        return message

    def wait_ready(self, timeout_s: float = 300) -> tuple[float, dict[str, Any]]:
        """Seconds from just before the spawn to the worker's ready line, and that line."""
        message = self._read(timeout_s)
        return time.perf_counter() - self.started, message

    def call(self, op: str, timeout_s: float = 600, **args: Any) -> dict[str, Any]:
        """Send `op` with `args`; its result. WorkerError if it failed."""
        stdin = self.process.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps({"op": op, **args}) + "\n")
            stdin.flush()
        except BrokenPipeError:
            raise WorkerError(f"the worker is gone:\n{self.log_tail()}") from None
        answer = self._read(timeout_s)
        if not answer.pop("ok", False):
            raise WorkerError(f"{op}: {answer.get('error')}")
        return answer

    def close(self, timeout_s: float = 30) -> None:
        """Close stdin (the worker's loop ends), then kill if it lingers."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
