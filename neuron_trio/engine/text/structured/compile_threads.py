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

Why round-robin by lane (issue 47, finding 5): one compile thread per model serves every
tenant; in arrival order, a key that kept 8 slow compiles open made another key's small
schema wait behind all of them (2 s -> 11 s). Each job names its lane (the tenant's name) and
the threads take the lane served longest ago first (a lane new or back from empty first of
all), so a job waits behind at most one compile of each other lane with work queued, and the
one already running.

Why at the lowest scheduling priority (nice 19, `COMPILE_NICE`; issue 47): the engine's step
runs its kernels on as many threads as the machine has cores, in many short parallel regions
that each end when their slowest thread does. A compile thread at the step's priority that
takes a core makes one of those threads wait a scheduler time slice in region after region:
measured on 2 cores (built-in model, 8 decode rows; issue 47's closing note),
steps of 12-13 ms took a median 113-121 ms and a p90 of 0.29-0.34 s while 1,999-key `const`
schemas compiled, against 13-14 ms and 15-17 ms with the compile thread at nice 19 (a
compile then took ~0.5 s instead of ~0.3 s: it runs on what the step leaves). On a bigger
machine a compile still gets any idle core at once; only a busy step keeps its cores.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["COMPILE_NICE", "COMPILE_STACK_BYTES", "CompileJob", "CompileThreads", "lower_priority"]

log = logging.getLogger(__name__)

COMPILE_STACK_BYTES = 64 << 20
# The compile threads' nice value: the lowest priority (raising it needs no privilege).
COMPILE_NICE = 19
# Lanes are tenants' names (bounded by the configuration); a second bound on memory.
MAX_LANES_REMEMBERED = 1024


class CompileJob:
    """One compile: `fn()` on a compile thread, then `on_done(job)` on that thread (the
    caller hands the result to its event loop). Exactly one of `result`/`error` is set when
    it ran; neither when it was withdrawn first.

    Invariant: a job runs at most once, and never after `withdraw()` returned True.
    """

    def __init__(
        self,
        fn: Callable[[], Any],
        on_done: Callable[[CompileJob], None],
        *,
        lane: Hashable = None,
    ) -> None:
        self.fn = fn
        self.on_done = on_done
        self.lane = lane  # whose compile (a tenant's name): the threads serve lanes in turn
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


class _Lanes:
    """Queued jobs by lane, taken round-robin: the lane served longest ago first (a lane never
    served, first of all; ties in the order the lanes queued).

    Invariant: every lane in `_lanes` holds at least one job; `_served` keeps the turn each
    lane was last served at (at most `MAX_LANES_REMEMBERED` lanes without queued jobs).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._lanes: dict[Hashable, deque[CompileJob]] = {}
        self._served: dict[Hashable, int] = {}
        self._turn = 0
        self._closed = False

    def put(self, job: CompileJob) -> None:
        with self._cond:
            self._lanes.setdefault(job.lane, deque()).append(job)
            self._cond.notify()

    def get(self) -> CompileJob | None:
        """The next job to run; None once closed and empty."""
        with self._cond:
            while (job := self._take()) is None:
                if self._closed:
                    return None
                self._cond.wait()
            return job

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _take(self) -> CompileJob | None:
        while self._lanes:
            lane = min(self._lanes, key=lambda name: self._served.get(name, -1))
            jobs = self._lanes[lane]
            job = jobs.popleft()
            if not jobs:
                del self._lanes[lane]
            if job.state != "queued":
                continue  # withdrawn: it costs its lane no turn
            self._turn += 1
            self._served[lane] = self._turn
            if len(self._served) > MAX_LANES_REMEMBERED:
                self._served = {k: v for k, v in self._served.items() if k in self._lanes}
            return job
        return None


class CompileThreads:
    """`size` daemon threads with `stack_bytes` of stack each, taking `CompileJob`s lane by
    lane in turn (oldest first within a lane).

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
        self._jobs = _Lanes()
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
        self._jobs.close()

    def _work(self) -> None:
        lower_priority()
        while (job := self._jobs.get()) is not None:
            try:
                job._run()
            except BaseException:  # on_done failed: log, keep the thread
                log.exception("grammar compile thread: a job's completion failed")


def lower_priority(nice: int = COMPILE_NICE) -> None:
    """Run the calling thread at `nice` (Linux: a thread's own nice value, by its thread id),
    so that it takes a core only when the engine's step threads leave one (see the module's
    docstring). Never raises the priority; elsewhere, or if refused, the thread keeps its own."""
    if not sys.platform.startswith("linux"):
        return  # the thread id is not a pid there: setpriority would name another process
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        log.warning("grammar compile thread: its priority stays (%s)", exc)
