"""The model's one forward thread (service/wedge/forward_thread.py) and its users: the load,
warm-up, probes and steps of one model all on one native thread (one OpenMP pool), with and
without a watchdog; a cancelled caller abandons its call as with trio's threads; closing the
model ends the thread. Real threads and the real clock: no MockClock (they do not mix)."""

from __future__ import annotations

import sys
import threading
from functools import partial
from typing import Any, cast

import pytest
import trio
import trio.testing

from neuron_trio.config import WatchdogConfig
from neuron_trio.executor.api import ModelExecutor
from neuron_trio.service.model_actor import ModelActor
from neuron_trio.service.requests.executor_calls import ExecutorCalls
from neuron_trio.service.wedge.deadman import Deadman
from neuron_trio.service.wedge.forward_thread import GIL_SWITCH_S, ForwardThread
from neuron_trio.service.wedge.watchdog import Watchdog

from ..actor_harness import spec
from ..fakes import FakeDeadman, FakeExecutor

WAIT_S = 10.0  # a bound on waits for real threads, never reached when it works
# How long a closed forward thread gets to end: less than trio's worker threads stay idle
# (10 s), so that a call left on one of those would not pass for a thread that ended.
JOIN_S = 5.0


class RecordingExecutor(FakeExecutor):
    """FakeExecutor recording (call, native thread id, thread name) of each blocking call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, str]] = []

    def _record(self, what: str) -> None:
        self.calls.append((what, threading.get_native_id(), threading.current_thread().name))

    def step(self) -> Any:
        self._record("step")
        return super().step()

    def probe(self) -> None:
        self._record("probe")
        super().probe()

    def warm_up(self) -> str:
        self._record("warm_up")
        return super().warm_up()


def thread_gone(native_id: int) -> bool:
    """Whether the thread `native_id` ends within JOIN_S."""
    for thread in threading.enumerate():
        if thread.native_id == native_id:
            thread.join(JOIN_S)
            return not thread.is_alive()
    return True


async def until(predicate: Any) -> None:
    with trio.fail_after(WAIT_S):
        while not predicate():
            await trio.sleep(0.005)


def watchdog() -> Watchdog:
    return Watchdog(
        model_name="m",
        deadlines=WatchdogConfig(step_timeout_s=30, abort_deadline_s=60),
        deadman=cast(Deadman, FakeDeadman()),
    )


@pytest.mark.parametrize("with_watchdog", [False, True])
def test_load_warm_up_probes_and_steps_run_on_one_thread_that_close_ends(
    with_watchdog: bool,
) -> None:
    executor = RecordingExecutor()
    load_thread: list[tuple[int, str]] = []

    def loader() -> ModelExecutor:
        load_thread.append((threading.get_native_id(), threading.current_thread().name))
        return cast(ModelExecutor, executor)

    async def main() -> None:
        calls = ExecutorCalls("m", watchdog() if with_watchdog else None)
        built = await calls.load(loader, timeout_s=WAIT_S)
        async with trio.open_nursery() as nursery:
            # Other work on one of trio's threads meanwhile (in the daemon: a close, the
            # deadman, a tokenizer): it takes the thread trio cached after the load.
            elsewhere = threading.Event()
            nursery.start_soon(partial(trio.to_thread.run_sync, elsewhere.wait, WAIT_S))
            await trio.testing.wait_all_tasks_blocked()
            await calls.warm_up(built)
            for _ in range(5):
                await calls.step(built, list)
                await calls.idle_probe(built, list)
            elsewhere.set()
        await calls.close(built)

    trio.run(main)
    assert [what for what, _, _ in executor.calls] == ["probe", "warm_up"] + 5 * ["step", "probe"]
    ids = {native_id for _, native_id, _ in executor.calls} | {load_thread[0][0]}
    assert len(ids) == 1, executor.calls
    (native_id,) = ids
    assert native_id != threading.get_native_id()
    # named after the call it runs, as trio's threads are (forensics show a hung step's name)
    assert load_thread[0][1] == "neuron-load-m"
    names = {name for what, _, name in executor.calls if what == "step"}
    assert names == {"neuron-step-m"}
    assert executor.closed
    assert thread_gone(native_id), "closing the model leaves its forward thread running"


def test_a_cancelled_caller_abandons_the_call_which_reports_and_then_the_next_runs() -> None:
    forward = ForwardThread("m")
    started, release = threading.Event(), threading.Event()
    returned: list[BaseException | None] = []
    order: list[str] = []

    def hung() -> str:
        started.set()
        release.wait(WAIT_S)
        order.append("hung")
        return "late"

    def nxt() -> str:
        order.append("next")
        return "next"

    async def main() -> None:
        limiter = trio.CapacityLimiter(1)
        cancelled = trio.Event()
        got = trio.Event()

        def on_return(error: BaseException | None) -> None:
            returned.append(error)
            got.set()

        async def caller(scope_box: list[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                scope_box.append(scope)
                await forward.run(
                    hung, thread_name="neuron-step-m", limiter=limiter, on_return=on_return
                )
                raise AssertionError("an abandoned call returned to its caller")
            assert scope.cancelled_caught
            cancelled.set()

        async with trio.open_nursery() as nursery:
            box: list[trio.CancelScope] = []
            nursery.start_soon(caller, box)
            await trio.to_thread.run_sync(started.wait, WAIT_S)
            box[0].cancel()
            with trio.fail_after(WAIT_S):
                await cancelled.wait()  # at once: the call is still running
            assert not returned and limiter.borrowed_tokens == 1  # it keeps its slot
            result: list[str] = []

            async def second() -> None:
                result.append(
                    await forward.run(
                        nxt, thread_name="neuron-step-m", limiter=limiter, on_return=lambda e: None
                    )
                )

            nursery.start_soon(second)
            await trio.sleep(0.05)
            assert order == []  # queued behind the hung call
            release.set()
            with trio.fail_after(WAIT_S):
                await got.wait()
            await until(lambda: result)
        assert returned == [None]
        assert result == ["next"] and order == ["hung", "next"]

    trio.run(main)
    forward.close()
    thread = forward.thread
    assert thread is not None
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_an_error_propagates_and_on_return_sees_it() -> None:
    forward = ForwardThread("m")
    seen: list[BaseException | None] = []

    def boom() -> None:
        raise ValueError("bad step")

    async def main() -> None:
        with pytest.raises(ValueError, match="bad step"):
            await forward.run(
                boom,
                thread_name="neuron-step-m",
                limiter=trio.CapacityLimiter(1),
                on_return=seen.append,
            )

    trio.run(main)
    forward.close()
    assert len(seen) == 1 and isinstance(seen[0], ValueError)


def test_unloading_the_model_ends_its_forward_thread() -> None:
    executor = RecordingExecutor()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            actor = ModelActor(spec(), lambda: cast(ModelExecutor, executor), max_queue=2)
            await nursery.start(actor.run)
            await actor.unload()

    trio.run(main)
    assert executor.closed and thread_gone(executor.calls[0][1])


def test_the_first_forward_thread_shortens_the_interpreters_switch_interval() -> None:
    # Between kernels the step retakes the GIL; with CPython's 5 ms each retake beside a busy
    # event loop waited 5 ms. Shortened, never lengthened (an embedding process may want less).
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        forward = ForwardThread("m")
        assert sys.getswitchinterval() == 0.005  # nothing until a forward thread starts

        async def main() -> float:
            return await forward.run(
                sys.getswitchinterval,
                thread_name="neuron-step-m",
                limiter=trio.CapacityLimiter(1),
                on_return=lambda _: None,
            )

        assert trio.run(main) == pytest.approx(GIL_SWITCH_S, abs=2e-6)
        forward.close()
        sys.setswitchinterval(GIL_SWITCH_S / 10)
        other = ForwardThread("n")
        trio.run(
            partial(
                other.run,
                sys.getswitchinterval,
                thread_name="neuron-step-n",
                limiter=trio.CapacityLimiter(1),
                on_return=lambda _: None,
            )
        )
        other.close()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S / 10, abs=2e-6)
    finally:
        sys.setswitchinterval(before)
