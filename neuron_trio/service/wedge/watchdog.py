"""The wedge watchdog of one model: step deadline, abort on its own thread, recovery or exit 70.

Why (docs/DESIGN.md, "Why it exists"): a tensor-parallel step once wedged in an NCCL collective,
and the abort meant to free it blocked forever too, so neither branch after it ever ran.
Here every blocking call runs on a worker thread the event loop does not wait for
(`abandon_on_cancel=True`), and every wait on such a thread has a deadline of its own:

    run_step(fn)         fn on thread "neuron-step-<model>" under watchdog.step_timeout_s
                         (the model's one forward thread, renamed while it runs a step)
      └─ past it         -> StepTimeoutError; the model is "recovering"
    recover(executor)    abort every rank's communicator on thread "nccl-abort-<model>"
      ├─ wait_for_return  returned / error / deadline (watchdog.abort_deadline_s from it)
      ├─ deadline        -> deadman: forensics, exit 70 (never returns)
      └─ came back       -> wedged step thread back (bounded), recreate_comm (bounded),
                            probe (bounded) -> serving again; any of them failing -> exit 70
    tp = 1               nothing to abort: the wedged step itself gets the abort deadline

How the model actor uses it (one Watchdog per model, one Deadman per process):

    watchdog = Watchdog(model_name=name, deadlines=watchdog_for(config, spec), deadman=deadman,
                        metrics=WatchdogMetrics.for_registry(registry))
    try:
        events = await watchdog.run_step(executor.step, inflight=actor.inflight)
        # idle for probe_interval_s instead: await watchdog.run_idle_probe(executor.probe)
    except StepTimeoutError:
        fail in-flight requests with 503 (watchdog.state is "recovering" now)
        await watchdog.recover(executor)      # returns only once serving again

Steps, probes and recovery of one model are serialised by one lock (the engine is not
thread-safe); the actor's loop is the only caller of steps and idle probes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal, NoReturn, TypeVar

import msgspec
import trio

from neuron_trio.config import WatchdogConfig
from neuron_trio.errors import StepTimeoutError, UnavailableError
from neuron_trio.executor.api import ModelExecutor
from neuron_trio.service.documents.timefmt import utc_iso
from neuron_trio.service.metrics.watchdog import WatchdogMetrics
from neuron_trio.service.model_state import HealthReport
from neuron_trio.service.wedge.deadman import Deadman
from neuron_trio.service.wedge.records import (
    InflightRequest,
    LastWedge,
    ReturnOutcome,
    WatchdogState,
    WatchdogStatistics,
)
from neuron_trio.service.wedge.threads import (
    ThreadRunner,
    WatchedCall,
    bounded_call,
    ignore_return,
    run_in_thread,
    wait_for_return,
)

__all__ = ["InflightFn", "StepTimeoutError", "Watchdog"]

log = logging.getLogger("neuron.watchdog")

T = TypeVar("T")
InflightFn = Callable[[], "list[InflightRequest]"]  # the requests in flight, for forensics

# The least time a model's first forwards (the warm-up) get: they pay one-time costs (CUDA
# context, kernel selection, NCCL connection set-up, or a busy CPU).
WARM_UP_MIN_S = 120.0


# --- the watchdog ----------------------------------------------------------------------------


class Watchdog:
    """The wedge watchdog of one model (see the module docstring for the flow)."""

    def __init__(
        self,
        *,
        model_name: str,
        deadlines: WatchdogConfig,  # config.watchdog_for: [watchdog] and the model's own
        deadman: Deadman,
        metrics: WatchdogMetrics | None = None,
        clock: Callable[[], float] = trio.current_time,
        wall_clock: Callable[[], float] = time.time,
        run_thread: ThreadRunner | None = None,  # None: run_in_thread (tests: a fake)
        logger: logging.Logger | None = None,
    ) -> None:
        self.model_name = model_name
        self.step_timeout_s = deadlines.step_timeout_s
        self.abort_deadline_s = deadlines.abort_deadline_s
        self.probe_interval_s = deadlines.probe_interval_s
        self._deadman = deadman
        self._metrics = metrics
        self._clock = clock
        self._wall = wall_clock
        self._run_thread: ThreadRunner = run_in_thread if run_thread is None else run_thread
        self._own_runner = run_thread is not None
        self._run_forward = self._run_thread  # the model's forwards: see forward_on
        self._log = logger or log
        self._step_limiter = trio.CapacityLimiter(1)
        self._busy = trio.Lock()
        self._state: WatchdogState = "idle"
        self._state_since = wall_clock()
        self._wedge: WatchedCall | None = None
        self._wedges = 0
        self._aborts = {"returned": 0, "error": 0, "deadline": 0}
        self._recoveries = 0
        self._probes = 0
        self._last_wedge: LastWedge | None = None
        self._health: HealthReport | None = None
        if metrics is not None:
            metrics.recovering.labels(model_name).set(0)

    def report_to(self, health: HealthReport) -> None:
        """The model's health (its actor's `ModelHealth`): told "wedged" when this watchdog
        fires the deadman, the one move of the model's that only the watchdog knows."""
        self._health = health

    def forward_on(self, runner: ThreadRunner) -> None:
        """Run the model's forwards (steps, probes, the warm-up) with `runner`: its
        ExecutorCalls' one forward thread (service/wedge/forward_thread.py: why one thread).
        A watchdog given a runner of its own (tests: a trio-native fake) keeps it for all."""
        if not self._own_runner:
            self._run_forward = runner

    def deadman_firing(self) -> bool:
        """Whether the shared deadman fires (for any model): the process is ending."""
        return self._deadman.firing

    # --- what others read -------------------------------------------------------------------

    @property
    def state(self) -> WatchdogState:
        return "wedged" if self._deadman.firing else self._state

    def statistics(self) -> WatchdogStatistics:
        last = self._last_wedge
        return WatchdogStatistics(
            state=self.state,
            since=utc_iso(self._state_since),
            step_timeout_s=self.step_timeout_s,
            abort_deadline_s=self.abort_deadline_s,
            probe_interval_s=self.probe_interval_s,
            wedges=self._wedges,
            aborts=dict(self._aborts),
            recoveries=self._recoveries,
            probes=self._probes,
            last_wedge=None if last is None else msgspec.structs.replace(last),
        )

    @property
    def warm_up_s(self) -> float:
        """The one bound on a model's warm-up calls (its first probe, its warm-up requests):
        never less than WARM_UP_MIN_S, nor than the time a wedged step gets."""
        return max(WARM_UP_MIN_S, self.step_timeout_s + self.abort_deadline_s)

    # --- steps ------------------------------------------------------------------------------

    async def run_step(
        self, fn: Callable[[], T], *, what: str = "step", inflight: InflightFn | None = None
    ) -> T:
        """Run `fn` (e.g. `executor.step`) on the model's step thread under step_timeout_s.

        `inflight()` is read the instant the call wedges, for `last_wedge` and forensics: the
        requests then in flight (the actor fails them with 503 right after, so the deadman,
        later, would find none).

        Raises StepTimeoutError if it runs past the deadline: the thread is abandoned (it
        may still come back; `recover` waits for that), the model is `recovering`, and the
        caller must call `recover(executor)` next. Raises UnavailableError (503) if the
        model is recovering already. Exceptions of `fn` propagate unchanged.

        Cancellation handling: if the caller is cancelled, the thread is abandoned and keeps
        the step limiter's only slot until it returns (a later step waits for it).
        """
        async with self._busy:
            self._ensure_serving()
            return await self._deadline_call(fn, what, inflight)

    def _ensure_serving(self) -> None:
        if self._wedge is not None or self.state not in ("idle", "stepping", "probing"):
            raise UnavailableError(
                f"model {self.model_name!r} is {self.state}", code=self.state, retry_after_s=5
            )

    async def _deadline_call(
        self, fn: Callable[[], T], what: str, inflight_fn: InflightFn | None
    ) -> T:
        now = self._clock()
        watch = WatchedCall(what=what, started=now, started_wall=self._wall())
        self._set_state("probing" if what == "probe" else "stepping")
        finished = False
        try:
            with trio.move_on_at(now + self.step_timeout_s):
                result = await self._run_forward(
                    fn,
                    thread_name=f"neuron-step-{self.model_name}",
                    limiter=self._step_limiter,
                    on_return=lambda error: watch.mark(error, self._clock()),
                )
                finished = True
        finally:
            if self._state in ("stepping", "probing"):
                self._set_state("idle")
        if finished:
            return result
        watch.detected = self._clock()
        self._wedge = watch
        self._wedges += 1
        inflight, inflight_error = _snapshot(inflight_fn)
        self._last_wedge = LastWedge(
            what=what,
            at=utc_iso(watch.started_wall),
            detected_after_s=round(watch.detected - watch.started, 3),
            outcome="recovering",
            inflight=inflight,
            inflight_error=inflight_error,
        )
        self._set_state("recovering")
        if self._metrics is not None:
            self._metrics.wedges.labels(self.model_name, what).inc()
        self._log.error(
            "watchdog: model %s: %s ran past step_timeout_s=%g: wedged; recovering",
            self.model_name,
            what,
            self.step_timeout_s,
        )
        raise StepTimeoutError(
            f"model {self.model_name!r}: {what} ran past step_timeout_s={self.step_timeout_s:g}"
        )

    # --- recovery ---------------------------------------------------------------------------

    async def recover(self, executor: ModelExecutor) -> None:
        """Recover after a StepTimeoutError (or a failed step): returns once the model serves
        again.

        Never returns otherwise: if the abort does not come back within abort_deadline_s of
        the wedge, or the wedged step thread, `recreate_comm` or the probe fails or hangs
        (each bounded by step_timeout_s), the deadman writes forensics and exits 70.
        Called without a pending wedge (a step that raised instead of hanging), it recovers
        the same way: with tp > 1 abort (nothing hangs, so it returns), re-create, probe.
        """
        async with self._busy:
            watch = self._wedge
            if watch is None:
                now = self._clock()
                watch = WatchedCall(what="failed step", started=now, started_wall=self._wall())
                watch.detected = now
                watch.mark(None, now)  # its thread did come back, with an error
                self._wedge = watch
                self._set_state("recovering")
            assert watch.detected is not None
            comm = executor.comm
            comms = [comm] if comm is not None else []
            abort_deadline = watch.detected + self.abort_deadline_s
            if executor.tp > 1:
                outcome = await self._abort(executor, abort_deadline)
                if outcome == "deadline":
                    await self._fire("abort-deadline", watch, comms, "the communicator abort")
                self._set_state("recovering")
                back = await wait_for_return(
                    watch.done, watch.result, self._clock() + self.step_timeout_s
                )
                if back == "deadline":
                    await self._fire(
                        "step-thread-stuck", watch, comms, "the step thread, after the abort"
                    )
                await self._recovery_call(executor.recreate_comm, "recreate_comm", watch, comms)
            else:
                # Nothing to abort: the step itself gets the abort deadline to come back.
                back = await wait_for_return(watch.done, watch.result, abort_deadline)
                if back == "deadline":
                    await self._fire("step-deadline", watch, comms, "the step (tp = 1)")
            await self._recovery_call(executor.probe, "probe", watch, comms)
            self._wedge = None
            self._recoveries += 1
            if self._last_wedge is not None:
                self._last_wedge.outcome = "recovered"
                self._last_wedge.recovered_after_s = round(self._clock() - watch.started, 3)
            if self._metrics is not None:
                self._metrics.recoveries.labels(self.model_name).inc()
            self._set_state("idle")
            self._log.warning(
                "watchdog: model %s recovered from a wedged %s in %.3f s",
                self.model_name,
                watch.what,
                self._clock() - watch.started,
            )

    async def _abort(self, executor: ModelExecutor, deadline: float) -> ReturnOutcome:
        """Abort every rank's communicator on a thread of its own; wait until `deadline`."""
        self._set_state("aborting")
        started = self._clock()
        self._log.warning("watchdog: model %s: aborting the communicator", self.model_name)
        outcome, result = await bounded_call(
            self._run_thread,
            executor.abort_comm,
            thread_name=f"nccl-abort-{self.model_name}",
            # A fresh limiter: an abandoned abort keeps its slot for ever.
            limiter=trio.CapacityLimiter(1),
            deadline=deadline,
            clock=self._clock,
        )
        duration = (result.finished_at if outcome != "deadline" else None) or self._clock()
        duration -= started
        self._aborts[outcome] += 1
        if self._last_wedge is not None:
            self._last_wedge.abort = outcome
            self._last_wedge.abort_s = round(duration, 3)
        if self._metrics is not None:
            self._metrics.aborts.labels(self.model_name, outcome).inc()
            self._metrics.abort_seconds.labels(self.model_name, outcome).observe(duration)
        if outcome == "deadline":
            self._log.critical(
                "watchdog: model %s: abort did not return within abort_deadline_s=%g",
                self.model_name,
                self.abort_deadline_s,
            )
        else:
            self._log.warning(
                "watchdog: model %s: abort %s after %.3f s%s",
                self.model_name,
                outcome,
                duration,
                f": {result.error!r}" if result.error is not None else "",
            )
        return outcome

    async def _recovery_call(
        self, fn: Callable[[], Any], what: str, watch: WatchedCall, comms: list[Any]
    ) -> None:
        """One recovery step on a worker thread, bounded by step_timeout_s; failing -> exit 70."""
        on_step_thread = what == "probe"
        outcome, result = await bounded_call(
            self._run_forward if on_step_thread else self._run_thread,
            fn,
            thread_name=f"neuron-step-{self.model_name}"
            if on_step_thread
            else f"nccl-init-{self.model_name}",
            limiter=self._step_limiter if on_step_thread else trio.CapacityLimiter(1),
            deadline=self._clock() + self.step_timeout_s,
            clock=self._clock,
        )
        if outcome == "returned":
            return
        why = (
            f"{what} ran past step_timeout_s={self.step_timeout_s:g}"
            if outcome == "deadline"
            else f"{what} failed: {result.error!r}"
        )
        self._log.critical("watchdog: model %s: recovery failed: %s", self.model_name, why)
        await self._fire(f"{what}-failed", watch, comms, why)

    async def _fire(
        self, reason: str, watch: WatchedCall, comms: list[Any], detail: str
    ) -> NoReturn:
        self._set_state("wedged")
        if self._health is not None:
            self._health.move("wedged", f"watchdog: {reason}: {detail}")
        last = self._last_wedge
        if self._last_wedge is not None:
            self._last_wedge.outcome = f"deadman: {reason}"
        await self._deadman.fire(
            reason,
            what=f"model {self.model_name}: {watch.what}",
            since=watch.started_wall,
            deadlines_s={
                "step_timeout_s": self.step_timeout_s,
                "abort_deadline_s": self.abort_deadline_s,
            },
            comms=comms,
            inflight_at_wedge=None if last is None else last.inflight,
            details={
                "model": self.model_name,
                "detail": detail,
                "watchdog": self.statistics(),
            },
        )

    # --- bounded one-off calls (load, communicator init/destroy, first steps) ---------------

    async def run_or_die(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        timeout_s: float | None = None,
        forward: bool = False,
    ) -> T:
        """Run a blocking call that must not hang (communicator init or destroy, a model's
        first steps) on a thread of its own, under `timeout_s`.

        The default bound is step_timeout_s + abort_deadline_s: the same time a wedged step
        gets before the deadman fires (a first step may be slower than the rest: lazy
        initialisation). Past it the deadman fires (forensics, exit 70): a model that wedges
        on load must end the process, not leave a start that never ends. Exceptions of `fn`
        propagate. With `forward` (the warm-up's forwards) it runs on the model's forward
        thread (`forward_on`). Cancellation handling: the thread is abandoned.
        """
        bound = timeout_s if timeout_s is not None else self.step_timeout_s + self.abort_deadline_s
        now = self._clock()
        watch = WatchedCall(what=what, started=now, started_wall=self._wall())
        with trio.move_on_at(now + bound):
            run_thread = self._run_forward if forward else self._run_thread
            return await run_thread(
                fn,
                thread_name=f"neuron-{what.replace(' ', '-')}-{self.model_name}",
                limiter=trio.CapacityLimiter(1),
                on_return=ignore_return,
            )
        watch.detected = self._clock()
        self._log.critical("watchdog: model %s: %s ran past %g s", self.model_name, what, bound)
        await self._fire(f"{what}-timeout", watch, [], f"{what} ran past {bound:g} s")

    # --- the idle probe ---------------------------------------------------------------------

    async def run_idle_probe(
        self, probe: Callable[[], object], *, inflight: InflightFn | None = None
    ) -> None:
        """One idle probe (`executor.probe`) under the step deadline, counted by result.

        The model actor calls it when its model has been idle for probe_interval_s (it alone
        knows when the engine is idle). Results: "ok"; "failed" (the probe raised);
        "wedged" (it ran past the step deadline). Raises as `run_step` does: on
        StepTimeoutError or a failure the caller recovers, exactly as after a step, so a
        broken model looks broken. A probe refused because the model is already recovering
        (UnavailableError) did not run and is not counted.
        """
        try:
            await self.run_step(probe, what="probe", inflight=inflight)
        except UnavailableError:
            raise
        except StepTimeoutError:
            self._count_probe("wedged")
            raise
        except Exception:
            self._count_probe("failed")
            raise
        self._count_probe("ok")

    def _count_probe(self, result: Literal["ok", "failed", "wedged"]) -> None:
        self._probes += 1
        if self._metrics is not None:
            self._metrics.probes.labels(self.model_name, result).inc()

    def _set_state(self, state: WatchdogState) -> None:
        if state != self._state:
            self._state = state
            self._state_since = self._wall()
            if self._metrics is not None:
                recovering = state in ("recovering", "aborting", "wedged")
                self._metrics.recovering.labels(self.model_name).set(1 if recovering else 0)


def _snapshot(
    inflight_fn: InflightFn | None,
) -> tuple[list[InflightRequest] | None, str | msgspec.UnsetType]:
    """The requests in flight, or (None, why) if reading them failed."""
    if inflight_fn is None:
        return None, msgspec.UNSET
    try:
        return list(inflight_fn()), msgspec.UNSET
    except Exception as exc:  # never let bookkeeping break the wedge path
        return None, f"{type(exc).__name__}: {exc}"
