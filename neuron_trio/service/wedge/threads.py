"""Blocking calls on worker threads the event loop never waits for, each with a deadline.

`wait_for_return` is the one decision the wedge path rests on: did a call on a thread come
back before its deadline? `run_in_thread` runs a call with `abandon_on_cancel=True` and reports
when it really returns (tests substitute a trio-native `ThreadRunner`); `bounded_call` joins
the two; a `WatchedCall` is the watchdog's record of one such call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import trio

from neuron_trio.service.wedge.records import ReturnOutcome

T = TypeVar("T")

# After the deadline fires, how many scheduling rounds (at the same clock instant) a call
# that came back at that instant gets to deliver its result. Each hop (thread runner ->
# abort task -> event) takes one round; checkpoints do not advance even a MockClock.
_SAME_INSTANT_ROUNDS = 16


# --- the decision ---------------------------------------------------------------------------


@dataclass
class CallReturn:
    """How a blocking call watched by `wait_for_return` came back (an abort, the wedged step,
    a re-creation, a probe): filled in, then the paired event is set. `error` is None if it
    returned normally (as trio's `outcome` carries a value or an error)."""

    error: BaseException | None = None
    finished_at: float | None = None  # trio clock


async def wait_for_return(done: trio.Event, result: CallReturn, deadline: float) -> ReturnOutcome:
    """Wait until `done` is set or the trio clock reaches `deadline`; say which.

    "returned": the call came back in time; "error": it came back in time with
    `result.error` set (it came back: a recovery can go on); "deadline": it did not.

    A call that comes back an instant before the deadline, or exactly at it, counts as back:
    when the deadline scope fires first, every task made runnable at that same instant is
    given its turn (a bounded number of checkpoints, which never move the clock) and the
    event is checked again before deciding. So the answer does not depend on the order in
    which trio runs tasks woken at the same instant.

    Touches no thread: test it with MockClock and trio-native fakes.
    """
    with trio.move_on_at(deadline):
        await done.wait()
    rounds = 0
    while not done.is_set() and rounds < _SAME_INSTANT_ROUNDS:
        await trio.lowlevel.cancel_shielded_checkpoint()
        rounds += 1
    if not done.is_set():
        return "deadline"
    return "error" if result.error is not None else "returned"


# --- threads ---------------------------------------------------------------------------------


class ThreadRunner(Protocol):
    """Runs `fn` on a worker thread with `abandon_on_cancel=True` semantics.

    `on_return(error)` is called in trio context once `fn` really returns (error None) or
    raises, even after the caller was cancelled and the thread abandoned. Tests substitute
    a trio-native fake (see tests/service/wedge/test_watchdog.py).
    """

    def __call__(
        self,
        fn: Callable[[], T],
        *,
        thread_name: str,
        limiter: trio.CapacityLimiter,
        on_return: Callable[[BaseException | None], None],
    ) -> Awaitable[T]: ...


async def run_in_thread(
    fn: Callable[[], T],
    *,
    thread_name: str,
    limiter: trio.CapacityLimiter,
    on_return: Callable[[BaseException | None], None],
) -> T:
    """The real ThreadRunner: `trio.to_thread.run_sync(fn, abandon_on_cancel=True, ...)`.

    Cancellation handling: the caller gets Cancelled at once; the thread runs on, keeps its
    `limiter` slot until it returns, and then reports through `on_return` (delivered with
    the run's TrioToken, dropped if the run has finished).
    """
    token = trio.lowlevel.current_trio_token()

    def body() -> T:
        error: BaseException | None = None
        try:
            return fn()
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                token.run_sync_soon(on_return, error)
            except trio.RunFinishedError:
                pass

    return await trio.to_thread.run_sync(
        body, abandon_on_cancel=True, thread_name=thread_name, limiter=limiter
    )


@dataclass
class WatchedCall:
    """One blocking call on a thread: when it started, and whether it has come back."""

    what: str
    started: float  # trio clock
    started_wall: float
    done: trio.Event = field(default_factory=trio.Event)
    result: CallReturn = field(default_factory=CallReturn)
    detected: float | None = None  # trio clock: when it ran past its deadline

    def mark(self, error: BaseException | None, now: float) -> None:
        if not self.done.is_set():
            self.result.error = error
            self.result.finished_at = now
            self.done.set()


def ignore_return(_error: BaseException | None) -> None:
    """An `on_return` for calls whose caller waits on their result alone."""


async def bounded_call(
    run_thread: ThreadRunner,
    fn: Callable[[], Any],
    *,
    thread_name: str,
    limiter: trio.CapacityLimiter,
    deadline: float,
    clock: Callable[[], float] = trio.current_time,
) -> tuple[ReturnOutcome, CallReturn]:
    """Run `fn` on a worker thread and wait for it until `deadline` (`wait_for_return`).

    Returns the outcome and the call's return record (its error, when it finished).
    Cancellation handling: past the deadline the thread is abandoned (it keeps its
    `limiter` slot until it really returns); the caller decides what that means.
    """
    done = trio.Event()
    result = CallReturn()

    async def call() -> None:
        try:
            await run_thread(fn, thread_name=thread_name, limiter=limiter, on_return=ignore_return)
        except Exception as exc:
            result.error = exc
        result.finished_at = clock()
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        outcome = await wait_for_return(done, result, deadline)
        nursery.cancel_scope.cancel()  # deadline: abandon the thread
    return outcome, result
