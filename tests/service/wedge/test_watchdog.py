"""The watchdog's step deadline, recovery and deadman decisions: MockClock (autojump), a
trio-native fake thread runner and scripted executor (tests/service/fakes.py), no threads
and no real sleeps."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import cast

import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from neuron_trio.config import WatchdogConfig
from neuron_trio.errors import CommError, StepTimeoutError, UnavailableError
from neuron_trio.service.metrics.watchdog import WatchdogMetrics
from neuron_trio.service.wedge.deadman import Deadman, DeadmanExit
from neuron_trio.service.wedge.records import InflightRequest
from neuron_trio.service.wedge.watchdog import InflightFn, Watchdog
from tests.service.fakes import FakeDeadman, FakeThreads, ScriptedExecutor
from tests.service.wedge.trio_seed import trio_seed

STEP_S = 2.0
ABORT_S = 3.0
PROBE_S = 30.0
TP = WatchdogConfig(step_timeout_s=STEP_S, abort_deadline_s=ABORT_S, probe_interval_s=PROBE_S)


def run_with(
    test: Callable[[Watchdog, FakeThreads, FakeDeadman], Awaitable[None]],
    *,
    registry: CollectorRegistry | None = None,
) -> FakeDeadman:
    deadman = FakeDeadman()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            runner = FakeThreads(nursery)
            watchdog = Watchdog(
                model_name="m",
                deadlines=TP,
                deadman=cast(Deadman, deadman),
                metrics=WatchdogMetrics.for_registry(registry) if registry else None,
                run_thread=runner,
                wall_clock=trio.current_time,
            )
            await test(watchdog, runner, deadman)
            nursery.cancel_scope.cancel()  # abandoned fake "threads"

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return deadman


async def wedge(
    watchdog: Watchdog, executor: ScriptedExecutor, inflight: InflightFn | None = None
) -> float:
    """Run a step that wedges; return the instant it started."""
    start = trio.current_time()
    with pytest.raises(StepTimeoutError):
        await watchdog.run_step(executor.step, inflight=inflight)
    assert trio.current_time() == start + STEP_S
    assert watchdog.state == "recovering"
    return start


def test_a_step_in_time_returns_its_value() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, _: FakeDeadman) -> None:
        executor = ScriptedExecutor(step=("sleep", STEP_S - 0.5))
        assert await watchdog.run_step(executor.step) == ["step"]
        assert watchdog.state == "idle"
        assert runner.threads == ["neuron-step-m"]

    run_with(test)


def test_a_step_error_propagates_and_is_not_a_wedge() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, _: FakeDeadman) -> None:
        executor = ScriptedExecutor(step="error")
        with pytest.raises(CommError):
            await watchdog.run_step(executor.step)
        assert watchdog.state == "idle" and watchdog.statistics().wedges == 0

    run_with(test)


def test_tp3_wedge_abort_returns_then_recovers() -> None:
    registry = CollectorRegistry()

    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(step="until-abort", abort=("sleep", 0.25))
        await wedge(watchdog, executor)
        # while recovering, new steps are refused with a 503
        with pytest.raises(UnavailableError):
            await watchdog.run_step(executor.step)
        await watchdog.recover(executor)
        assert executor.names() == ["step", "abort", "recreate", "probe"]
        assert "nccl-abort-m" in runner.threads
        assert watchdog.state == "idle"
        stats = watchdog.statistics()
        assert stats.wedges == 1 and stats.recoveries == 1
        assert stats.aborts == {"returned": 1, "error": 0, "deadline": 0}
        assert stats.last_wedge is not None and stats.last_wedge.outcome == "recovered"
        assert await watchdog.run_step(executor.step) == ["step"]
        assert not deadman.fired

    run_with(test, registry=registry)
    assert (
        registry.get_sample_value("neuron_watchdog_wedges_total", {"model": "m", "what": "step"})
        == 1
    )
    assert (
        registry.get_sample_value(
            "neuron_watchdog_aborts_total", {"model": "m", "outcome": "returned"}
        )
        == 1
    )
    assert registry.get_sample_value("neuron_watchdog_recoveries_total", {"model": "m"}) == 1
    assert registry.get_sample_value("neuron_watchdog_recovering", {"model": "m"}) == 0
    assert (
        registry.get_sample_value(
            "neuron_watchdog_abort_duration_seconds_sum", {"model": "m", "outcome": "returned"}
        )
        == 0.25
    )


def test_tp3_abort_hangs_deadman_fires_at_the_deadline() -> None:
    registry = CollectorRegistry()

    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(step="until-abort", abort="hang")
        requests = [InflightRequest("m", 1, "running", 1.0, 5, 2)]
        start = await wedge(watchdog, executor, inflight=lambda: list(requests))
        requests.clear()  # the actor fails them with 503 right after the wedge
        with pytest.raises(DeadmanExit):
            await watchdog.recover(executor)
        [fired] = deadman.fired
        assert fired["reason"] == "abort-deadline"
        assert fired["at"] == start + STEP_S + ABORT_S
        assert fired["since"] == start  # wall clock is the virtual clock here
        assert fired["deadlines_s"] == {"step_timeout_s": STEP_S, "abort_deadline_s": ABORT_S}
        assert fired["comms"] == [executor.comm]
        assert fired["inflight_at_wedge"] == [InflightRequest("m", 1, "running", 1.0, 5, 2)]
        assert watchdog.state == "wedged"
        assert "recreate" not in executor.names()

    run_with(test, registry=registry)
    assert (
        registry.get_sample_value(
            "neuron_watchdog_aborts_total", {"model": "m", "outcome": "deadline"}
        )
        == 1
    )


@pytest.mark.parametrize("margin", [1e-9, 0.0])
def test_tp3_abort_landing_at_the_last_instant_is_a_recovery(margin: float) -> None:
    for seed in range(20):

        def lands(executor: ScriptedExecutor) -> float:
            # The same arithmetic as the watchdog's deadline: detected + abort_deadline_s.
            assert executor.step_started is not None
            return (executor.step_started + STEP_S) + ABORT_S - margin

        async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
            executor = ScriptedExecutor(step="until-abort", abort=("sleep_until", lands))
            await wedge(watchdog, executor)
            await watchdog.recover(executor)
            assert watchdog.statistics().aborts["returned"] == 1
            assert not deadman.fired

        with trio_seed(seed):
            run_with(test)


def test_tp3_abort_error_came_back_and_recovers() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(step="until-abort", abort="error")
        await wedge(watchdog, executor)
        await watchdog.recover(executor)
        assert executor.names()[-2:] == ["recreate", "probe"]
        assert watchdog.statistics().aborts["error"] == 1
        assert watchdog.state == "idle" and not deadman.fired

    run_with(test)


def test_tp3_abort_returns_but_the_step_thread_never_does() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(step="hang", abort="ok")
        start = await wedge(watchdog, executor)
        with pytest.raises(DeadmanExit):
            await watchdog.recover(executor)
        assert deadman.fired[0]["reason"] == "step-thread-stuck"
        assert deadman.fired[0]["at"] == start + STEP_S + STEP_S

    run_with(test)


@pytest.mark.parametrize(
    ("recreate", "probe", "reason"),
    [
        ("hang", "ok", "recreate_comm-failed"),
        ("error", "ok", "recreate_comm-failed"),
        ("ok", "hang", "probe-failed"),
        ("ok", "error", "probe-failed"),
    ],
)
def test_tp3_recreate_or_probe_failing_fires(recreate: str, probe: str, reason: str) -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(step="until-abort", recreate=recreate, probe=probe)
        await wedge(watchdog, executor)
        with pytest.raises(DeadmanExit):
            await watchdog.recover(executor)
        assert deadman.fired[0]["reason"] == reason

    run_with(test)


def test_tp1_step_that_never_returns_fires_after_step_timeout_plus_abort_deadline() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(tp=1, step="hang")
        start = await wedge(watchdog, executor)
        with pytest.raises(DeadmanExit):
            await watchdog.recover(executor)
        [fired] = deadman.fired
        assert fired["reason"] == "step-deadline"
        assert fired["at"] == start + STEP_S + ABORT_S
        assert fired["comms"] == []
        assert "abort" not in executor.names()

    run_with(test)


def test_tp1_step_that_comes_back_within_the_abort_deadline_recovers() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(tp=1, step=("sleep", STEP_S + ABORT_S - 0.01))
        await wedge(watchdog, executor)
        await watchdog.recover(executor)
        assert executor.names() == ["step", "probe"]  # nothing to abort or re-create
        assert watchdog.state == "idle" and not deadman.fired

    run_with(test)


def test_recover_after_a_failed_step_recreates_the_communicator() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(step="error")
        with pytest.raises(CommError):
            await watchdog.run_step(executor.step)
        await watchdog.recover(executor)
        assert executor.names() == ["step", "abort", "recreate", "probe"]
        assert watchdog.state == "idle" and not deadman.fired

    run_with(test)


def test_idle_probes_are_counted_by_result() -> None:
    registry = CollectorRegistry()

    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(probe="ok")
        await watchdog.run_idle_probe(executor.probe)
        executor.behaviour["probe"] = "until-abort"
        with pytest.raises(StepTimeoutError):
            await watchdog.run_idle_probe(executor.probe)
        # refused while recovering: did not run, not counted
        with pytest.raises(UnavailableError):
            await watchdog.run_idle_probe(executor.probe)
        await watchdog.recover(executor)
        stats = watchdog.statistics()
        assert stats.last_wedge is not None and stats.last_wedge.what == "probe"
        executor.behaviour["probe"] = "error"
        with pytest.raises(CommError):
            await watchdog.run_idle_probe(executor.probe)
        await watchdog.recover(executor)
        assert watchdog.state == "idle" and not deadman.fired
        stats = watchdog.statistics()
        assert stats.probes == 3 and stats.recoveries == 2

    run_with(test, registry=registry)
    for result in ("ok", "failed", "wedged"):
        value = registry.get_sample_value(
            "neuron_watchdog_idle_probes_total", {"model": "m", "result": result}
        )
        assert value == 1, result
    assert (
        registry.get_sample_value("neuron_watchdog_wedges_total", {"model": "m", "what": "probe"})
        == 1
    )


def test_run_or_die_fires_when_a_load_step_hangs() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(probe="hang")
        assert await watchdog.run_or_die(executor.step, what="warm-up") == ["step"]
        with pytest.raises(DeadmanExit):
            await watchdog.run_or_die(executor.probe, what="warm-up", timeout_s=7.0)
        assert deadman.fired[0]["reason"] == "warm-up-timeout"
        assert deadman.fired[0]["at"] == 7.0

    run_with(test)


def test_run_or_die_default_bound_is_step_timeout_plus_abort_deadline() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        executor = ScriptedExecutor(step=("sleep", STEP_S + ABORT_S - 0.01), probe="hang")
        await watchdog.run_or_die(executor.step, what="warm-up")  # slow first step: fine
        start = trio.current_time()
        with pytest.raises(DeadmanExit):
            await watchdog.run_or_die(executor.probe, what="comm init")
        assert deadman.fired[0]["at"] == start + STEP_S + ABORT_S
        assert runner.threads[-1] == "neuron-comm-init-m"

    run_with(test)


def test_statistics_keep_the_v1_node_shape() -> None:
    async def test(watchdog: Watchdog, runner: FakeThreads, deadman: FakeDeadman) -> None:
        doc = msgspec.to_builtins(watchdog.statistics())
        assert list(doc) == [
            "state", "since", "step_timeout_s", "abort_deadline_s", "probe_interval_s",
            "wedges", "aborts", "recoveries", "probes", "last_wedge",
        ]  # fmt: skip
        assert doc["state"] == "idle" and doc["since"].endswith("Z")
        assert doc["step_timeout_s"] == STEP_S and doc["abort_deadline_s"] == ABORT_S
        assert doc["last_wedge"] is None
        executor = ScriptedExecutor(step="until-abort", abort=("sleep", 0.25))
        await wedge(watchdog, executor, inflight=list)
        wedged = msgspec.to_builtins(watchdog.statistics())["last_wedge"]
        # keys appear as the recovery goes on (abort, then its outcome), never as nulls
        assert list(wedged) == ["what", "at", "detected_after_s", "outcome", "inflight"]
        await watchdog.recover(executor)
        last = msgspec.to_builtins(watchdog.statistics())["last_wedge"]
        assert last == {
            "what": "step",
            "at": wedged["at"],
            "detected_after_s": STEP_S,
            "outcome": "recovered",
            "inflight": [],
            "abort": "returned",
            "abort_s": 0.25,
            "recovered_after_s": STEP_S + 0.25,
        }

    run_with(test)


def test_real_thread_runner_reports_an_abandoned_thread_returning() -> None:
    """The real runner (a real thread, real clock: no MockClock here): cancelled at once,
    and on_return still arrives when the thread finally returns."""
    import threading

    from neuron_trio.service.wedge.threads import run_in_thread

    release = threading.Event()
    returned: list[BaseException | None] = []

    async def main() -> None:
        got = trio.Event()

        def on_return(error: BaseException | None) -> None:
            returned.append(error)
            got.set()

        with trio.move_on_after(0.05):
            await run_in_thread(
                release.wait,
                thread_name="neuron-step-t",
                limiter=trio.CapacityLimiter(1),
                on_return=on_return,
            )
        assert not returned
        release.set()
        with trio.fail_after(5):
            await got.wait()

    trio.run(main)
    assert returned == [None]


@pytest.mark.parametrize(("step_s", "abort_s", "bound"), [(2.0, 3.0, 120.0), (30.0, 100.0, 130.0)])
def test_the_warm_up_bound_is_the_minimum_or_a_wedged_steps_time(
    step_s: float, abort_s: float, bound: float
) -> None:
    watchdog = Watchdog(
        model_name="m",
        deadlines=WatchdogConfig(step_timeout_s=step_s, abort_deadline_s=abort_s),
        deadman=cast(Deadman, FakeDeadman()),
        wall_clock=lambda: 0.0,
    )
    assert watchdog.warm_up_s == bound
