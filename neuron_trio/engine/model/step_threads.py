"""How many threads a CPU step's kernels use: as many as the process starts with, or fewer
while other work keeps some of the cores busy (issue 47).

Why: the kernels (the native kernel's OpenMP regions, and torch's) split each product evenly
between their threads, in hundreds of short parallel regions a step, each ending when its
slowest thread does. With as many threads as cores, any other runnable thread (another
process, the node's own event loop under a flood of connections, a grammar compile) takes a
core from one of them, and region after region waits a scheduler time slice for it while
the others spin. Measured on 2 cores (built-in model, 8 decode rows, each step timed;
issue 47's closing note): steps of 13-15 ms on 2 threads took a median 48-194 ms (p90 up to
1.5 s) beside one busy process, and 356-720 ms beside a busy Python thread of the process;
on 1 thread the same took 40-51 ms and 62 ms (21 ms alone).

So every `WINDOW_S` of steps, the time the rest of the machine kept the step's cores busy
(their busy time less the step's own threads') decides the next count: the cores left free
of it, rounded, at least 1 and at most the starting count. A step on fewer threads gives
the same tokens (each row's sums are the kernel's, whatever the split). Linux only (per-CPU
idle time from /proc/stat); elsewhere the count never changes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["WINDOW_S", "StepThreads", "idle_seconds"]

WINDOW_S = 0.25  # steps' time between two decisions (/proc/stat counts in 10 ms ticks)
GAP_S = 1.0  # a pause between steps longer than this starts a new window (an idle node)
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def idle_seconds(cpus: Iterable[int]) -> float | None:
    """Idle time (idle + iowait) of `cpus` since boot, from /proc/stat; None if unreadable."""
    wanted = {f"cpu{c}" for c in cpus}
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().decode("ascii", "replace").splitlines()
    except OSError:
        return None
    idle = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted and len(fields) > 5:
            idle += int(fields[4]) + int(fields[5])
    return idle * _TICK_S


class StepThreads:
    """The kernels' thread count for the steps of one engine, run on the calling thread.

    `threads`: the starting count (torch's). `cpus`: the CPUs this process may run on.
    `read_idle`, `clock`, `thread_clock`, `set_threads`: injectable for tests.
    Invariant: 1 <= `current` <= `threads`.
    """

    def __init__(
        self,
        threads: int | None = None,
        cpus: Iterable[int] | None = None,
        *,
        read_idle: Callable[[Iterable[int]], float | None] = idle_seconds,
        clock: Callable[[], float] = time.monotonic,
        thread_clock: Callable[[], float] = time.thread_time,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.threads = max(1, threads if threads is not None else torch.get_num_threads())
        if cpus is None:
            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
        self.cpus = sorted(cpus)
        self.current = self.threads
        self._read_idle, self._clock, self._thread_clock = read_idle, clock, thread_clock
        self._set_threads = set_threads
        self._window: tuple[float, float] | None = None  # (start, idle seconds then)
        self._team_s = 0.0  # CPU time of the step's threads in the window
        self._last_end = 0.0

    @contextmanager
    def forward(self) -> Iterator[int]:
        """A step's forwards, on the calling thread with `current` kernel threads (set on this
        thread each time: OpenMP's count is a thread's own, and steps may move between
        threads); yields that count."""
        self._set_threads(self.current)
        start, cpu = self._clock(), self._thread_clock()
        if self._window is not None and start - self._last_end > GAP_S:
            self._window = None  # the machine between steps is not what a step competes with
        if self._window is None:
            idle = self._read_idle(self.cpus) if len(self.cpus) > 1 else None
            self._window = None if idle is None else (start, idle)
            self._team_s = 0.0
        try:
            yield self.current
        finally:
            self._last_end = self._clock()
            # the team's threads split the work evenly: each about the calling thread's time
            self._team_s += (self._thread_clock() - cpu) * self.current
            self._decide()

    def _decide(self) -> None:
        if self._window is None or self._last_end - self._window[0] < WINDOW_S:
            return
        start, idle_then = self._window
        idle_now = self._read_idle(self.cpus)
        self._window = None
        if idle_now is None:
            return
        wall = self._last_end - start
        others = len(self.cpus) - (idle_now - idle_then + self._team_s) / wall  # cores
        free = len(self.cpus) - max(0.0, others)
        self.current = max(1, min(self.threads, int(free + 0.5)))
