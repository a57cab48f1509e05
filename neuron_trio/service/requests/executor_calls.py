"""A model's blocking executor calls, each on a worker thread the event loop never blocks on.

`ExecutorCalls` is how a model actor reaches its executor: the load (abandon-safe, bounded by
`node.load_timeout_s`), the warm-up, every step and idle probe, and the close. With a
watchdog, steps and probes run under its deadlines (`run_step`, `run_idle_probe`) and the
warm-up under its warm-up bound (a hang there is exit 70); without one (tests, tools) they run
unbounded, one at a time. The load, warm-up, steps and probes all run on the model's one
forward thread (service/wedge/forward_thread.py: a second thread that ran torch's parallel
regions made every step several times slower); `close` ends it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from neuron_trio.errors import ModelLoadError
from neuron_trio.executor.api import ModelExecutor, SequenceEvent, panics_as_model_file_errors
from neuron_trio.service.wedge.forward_thread import ForwardThread
from neuron_trio.service.wedge.threads import ignore_return
from neuron_trio.service.wedge.watchdog import InflightFn, Watchdog

log = logging.getLogger(__name__)

T = TypeVar("T")


class ExecutorCalls:
    """The blocking calls of model `name`'s executor, bounded by `watchdog` when there is one."""

    def __init__(self, name: str, watchdog: Watchdog | None) -> None:
        self.name = name
        self.watchdog = watchdog
        self._limiter = trio.CapacityLimiter(1)  # a hung step keeps only this slot
        self._forward = ForwardThread(name)
        if watchdog is not None:
            watchdog.forward_on(self._forward.run)

    async def load(self, loader: Callable[[], ModelExecutor], timeout_s: float) -> ModelExecutor:
        """Build the executor on a worker thread; ModelLoadError past `timeout_s`.

        Cancellation handling: the thread is abandoned; whatever it builds afterwards is
        closed on its own thread, so an interrupted load leaks nothing for long.
        """
        try:
            with trio.fail_after(timeout_s):
                return await self._build(loader)
        except trio.TooSlowError:
            raise ModelLoadError(
                f"model {self.name!r}: loading took longer than {timeout_s:g} s "
                "(node.load_timeout_s)"
            ) from None

    async def _build(self, loader: Callable[[], ModelExecutor]) -> ModelExecutor:
        lock = threading.Lock()
        abandoned = False
        built: list[ModelExecutor] = []

        def build() -> ModelExecutor:
            executor = loader()
            with lock:
                if abandoned:
                    executor.close()
                else:
                    built.append(executor)
            return executor

        try:
            with panics_as_model_file_errors(f"model {self.name!r}"):
                return await self._forward.run(
                    build,
                    thread_name=f"neuron-load-{self.name}",
                    limiter=trio.CapacityLimiter(1),
                    on_return=ignore_return,
                )
        except trio.Cancelled:
            with lock:
                abandoned = True
                leftovers = list(built)
            for executor in leftovers:
                threading.Thread(target=executor.close, daemon=True).start()
            raise

    async def warm_up(self, executor: ModelExecutor) -> None:
        """The model's first forward (a probe), then its warm-up requests (`engine.warm_up`:
        the first real request then pays no one-time cost), each bounded: a hang here ends in
        exit 70 (the deadman); an error fails the load.

        The bound is the watchdog's `warm_up_s` (generous: first forwards pay one-time costs).
        """
        started = time.monotonic()
        if self.watchdog is not None:
            timeout_s = self.watchdog.warm_up_s
            await self.watchdog.run_or_die(
                executor.probe, what="warm-up", timeout_s=timeout_s, forward=True
            )
            report = await self.watchdog.run_or_die(
                executor.warm_up, what="warm-up", timeout_s=timeout_s, forward=True
            )
        else:
            await self._plain_thread(executor.probe, "warm-up")
            report = await self._plain_thread(executor.warm_up, "warm-up")
        log.info(
            "model %s: warmed up in %.2f s (%s)", self.name, time.monotonic() - started, report
        )

    async def step(self, executor: ModelExecutor, inflight: InflightFn) -> list[SequenceEvent]:
        """One engine step off the trio thread, under the watchdog (when there is one).

        Raises StepTimeoutError past the step deadline (then `recover` must follow).
        Cancellation handling: the thread is abandoned and keeps the step limiter's slot.
        """
        if self.watchdog is not None:
            return await self.watchdog.run_step(executor.step, inflight=inflight)
        return await self._plain_thread(executor.step, "step")

    async def idle_probe(self, executor: ModelExecutor, inflight: InflightFn) -> None:
        """The idle probe: one tiny forward, counted by the watchdog (ok, failed, wedged)."""
        if self.watchdog is not None:
            await self.watchdog.run_idle_probe(executor.probe, inflight=inflight)
        else:
            await self._plain_thread(executor.probe, "probe")

    async def close(self, executor: ModelExecutor) -> None:
        """Close the executor, then end the forward thread (a reload gets a fresh one)."""
        try:
            await trio.to_thread.run_sync(
                executor.close, abandon_on_cancel=True, thread_name=f"neuron-close-{self.name}"
            )
        finally:
            self.close_thread()

    def close_thread(self) -> None:
        """End the forward thread once the calls already on it return (idempotent): when the
        actor stops, whether or not it had an executor to close."""
        self._forward.close()

    async def _plain_thread(self, fn: Callable[[], T], what: str) -> T:
        return await self._forward.run(
            fn,
            thread_name=f"neuron-{what}-{self.name}",
            limiter=self._limiter,
            on_return=ignore_return,
        )
