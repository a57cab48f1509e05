"""Grammar compiles on threads of their own, with a large stack, that a caller can withdraw.

Why threads (and not a worker process): a compiled grammar is an llguidance matcher, a Rust
object that cannot leave the process it was built in; a worker process could only *try* a
compile, and the node would then compile the schema again (twice the CPU of every new
schema), with the tokenizer (49 152 tokens and the Python encode it calls back) rebuilt in
the worker. So compiles run in the node, made safe by three things together:

- bounds on the schema before the compiler sees it (`schema_limits`), under which the
  costliest shapes measured need less than 1 MB of stack, where the crashing input (30 000
  const keys) overflowed 8 MB;
- `COMPILE_STACK_BYTES` of stack on these threads (address space: only the pages touched
  are memory), 64 times what a compile within the bounds was measured to need;
- Rust panics (pyo3's PanicException, a BaseException) caught where llguidance is called
  (`grammar.GrammarCompiler`), a 400.

Why threads of their own (issue 25, finding 4): on trio's default limiter (40 threads,
shared with every other `to_thread` call), 60 heavy compiles sent and abandoned kept running
and starved the rest (a long chat went from 2 s to 51 s). Here at most `size` compiles run at
once; a job whose caller left before a thread took it is dropped (`CompileJob.withdraw`), so
an abandoned request costs at most the compile already running, which the bounds keep under
about a second.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["COMPILE_STACK_BYTES", "CompileJob", "CompileThreads"]

log = logging.getLogger(__name__)

COMPILE_STACK_BYTES = 64 << 20

_STOP = None


class CompileJob:
    """One compile: `fn()` on a compile thread, then `on_done(job)` on that thread (the
    caller hands the result to its event loop). Exactly one of `result`/`error` is set when
    it ran; neither when it was withdrawn first.

    Invariant: a job runs at most once, and never after `withdraw()` returned True.
    """

    def __init__(self, fn: Callable[[], Any], on_done: Callable[[CompileJob], None]) -> None:
        self.fn = fn
        self.on_done = on_done
        self.result: Any = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._state = "queued"  # queued -> running -> done, or queued -> withdrawn

    @property
    def state(self) -> str:
        return self._state

    def withdraw(self) -> bool:
        """Drop the job if no thread has taken it yet: True if it will never run. False if it
        is running (it runs to its end: the compiler cannot be interrupted) or done."""
        with self._lock:
            if self._state == "queued":
                self._state = "withdrawn"
                return True
            return False

    def _take(self) -> bool:
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "running"
            return True

    def _run(self) -> None:
        if not self._take():
            return
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the caller; a thread must never die of it
            self.error = exc
        self._state = "done"
        self.on_done(self)


class CompileThreads:
    """`size` daemon threads with `stack_bytes` of stack each, taking `CompileJob`s in order.

    Cancellation handling: a job is withdrawn, never interrupted; `close()` stops the threads
    once the jobs already submitted have run (or been withdrawn).
    """

    def __init__(
        self,
        size: int = 1,
        *,
        name: str = "grammar-compile",
        stack_bytes: int = COMPILE_STACK_BYTES,
    ) -> None:
        self._jobs: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # threading.stack_size is process-wide, but only for threads started while it is set:
        # a thread another part of the node starts in this instant gets a larger (virtual)
        # stack, which costs nothing.
        previous = threading.stack_size(stack_bytes)
        try:
            for i in range(size):
                thread = threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        finally:
            threading.stack_size(previous)

    def submit(self, job: CompileJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Stop the threads after the jobs submitted so far."""
        for _ in self._threads:
            self._jobs.put(_STOP)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            try:
                job._run()
            except BaseException:  # on_done failed: log, keep the thread
                log.exception("grammar compile thread: a job's completion failed")
