"""One long-lived thread per model for every call that runs the model's forwards.

Why: each thread that runs a multi-threaded torch or native-kernel region owns an OpenMP
(libgomp) thread pool for as long as it lives. With a second live pool in the process,
libgomp manages more threads than there are CPUs and throttles its spin-wait to a few
hundred spins, so every one of a step's hundreds of parallel regions waits for a futex
wake-up. Measured through the daemon (built-in model, 2 vCPUs; bench/bench_http.py,
the fourth round's third closing note): 1 stream ~30-40 tok/s with the load's and the steps' trio worker threads both
alive (trio caches its threads and reuses them for any job), 111-142 tok/s with the load,
warm-up, probes and steps all on one thread. So a model's load, warm-up, probes and steps
run here, one at a time, in the order submitted.

The thread needs the GIL back between kernels (a step of the built-in model releases and
retakes it hundreds of times). While the event loop runs Python (a burst of HTTP/2 frames,
a large request body), each retake waited CPython's switch interval, 5 ms: a step of 8 decode
rows took 52-206 ms beside a busy Python thread. The first forward thread sets it to
`GIL_SWITCH_S` for the process: 36-40 ms (10 ms alone; bench: the fourth round's fourth
closing note); two busy Python threads then trade the GIL ten times as often, a cost
of microseconds a switch.

`ForwardThread.run` is a `ThreadRunner` (service/wedge/threads.py) with the same
cancellation handling as `run_in_thread`: the caller gets Cancelled at once, the call runs
on, keeps its `limiter` slot until it returns, and reports through `on_return`. A hung call
holds up the calls queued behind it, as the per-model limiter of 1 does anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")

# The interpreter's switch interval once a model runs forwards (CPython's default: 5 ms).
GIL_SWITCH_S = 0.0005

_Job = Callable[[], None]


class ForwardThread:
    """A daemon thread named `neuron-forward-<model>` that runs submitted calls one at a time.

    Started by the first call. While a call runs, the thread carries that call's name
    (`neuron-step-<model>`, `neuron-load-<model>`, ...), as trio's worker threads do, so that
    forensics say which call a hung thread is in. `close()` ends it once the calls already
    submitted have returned; a thread stuck in a hung call is left behind (it is a daemon).
    """

    def __init__(self, model_name: str) -> None:
        self.name = f"neuron-forward-{model_name}"
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread, once started (tests join it)."""
        return self._thread

    def close(self) -> None:
        """Let the thread end after the calls already submitted. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None:
                self._jobs.put(None)

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if self._thread is None:
                sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    async def run(
        self,
        fn: Callable[[], T],
        *,
        thread_name: str,
        limiter: trio.CapacityLimiter,
        on_return: Callable[[BaseException | None], None],
    ) -> T:
        """Run `fn` on this thread (named `thread_name` meanwhile); its value or its error.

        Cancellation handling: cancelled while waiting for `limiter`, nothing runs; once
        submitted, the caller gets Cancelled at once and the call is abandoned: it runs on,
        keeps its `limiter` slot until it returns, and then reports through `on_return`
        (delivered with the run's TrioToken, dropped if the run has finished).
        """
        placeholder = object()
        await limiter.acquire_on_behalf_of(placeholder)
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        abandoned = False  # read and written on the trio thread only

        def deliver(result: outcome.Outcome[T]) -> None:  # on the trio thread
            try:
                on_return(result.error if isinstance(result, outcome.Error) else None)
            finally:
                limiter.release_on_behalf_of(placeholder)
                if not abandoned:
                    trio.lowlevel.reschedule(task, result)

        def job() -> None:  # on this thread
            result = self._named(thread_name, fn)
            try:
                token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:
                pass

        try:
            self._submit(job)
        except BaseException:
            limiter.release_on_behalf_of(placeholder)
            raise

        def abort(_raise_cancel: Any) -> trio.lowlevel.Abort:
            nonlocal abandoned
            abandoned = True
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]

    def _named(self, name: str, fn: Callable[[], T]) -> outcome.Outcome[T]:
        thread = threading.current_thread()
        thread.name = name
        _set_os_thread_name(name)
        try:
            return outcome.capture(fn)
        finally:
            thread.name = self.name
            _set_os_thread_name(self.name)


def _load_setname() -> Callable[[bytes], None] | None:
    """pthread_setname_np on the calling thread, where libc has it (Linux); else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        setname = libc.pthread_setname_np
        self_ = libc.pthread_self
    except (OSError, AttributeError):
        return None
    self_.restype = ctypes.c_void_p
    setname.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return lambda name: setname(self_(), name)


_SETNAME = _load_setname()


def _set_os_thread_name(name: str) -> None:
    """The name `top -H` and /proc show (15 bytes at most), as trio's threads set theirs."""
    if _SETNAME is not None:
        _SETNAME(name.encode("ascii", "replace")[:15])
