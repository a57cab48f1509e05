"""`wait_for_return`, the deadman's decision: MockClock, trio-native fakes, no threads.

Each case runs 100 times, each a fresh `trio.run` with its own seed for trio's scheduler
(which reverses each batch of runnable tasks at random), with the aborter started before
or after the waiter, and with its result delivered through 0 to 3 extra hops (a thread
runner's completion, then the abort task, then the event), so the outcome is shown not
to depend on the order in which tasks woken at the same instant run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio
import trio.testing

from neuron_trio.errors import CommError
from neuron_trio.service.wedge.records import ReturnOutcome
from neuron_trio.service.wedge.threads import CallReturn, wait_for_return
from tests.service.wedge.trio_seed import trio_seed

DEADLINE_S = 60.0
REPEATS = 100


def decide(
    *,
    seed: int,
    lands_at: float | None,
    error: bool = False,
    hops: int = 0,
    aborter_first: bool = True,
) -> tuple[ReturnOutcome, float]:
    """Run one scenario; return the decision and the (virtual) instant it was made.

    `lands_at`: seconds after the base when the abort comes back (None: never).
    """
    clock = trio.testing.MockClock(autojump_threshold=0)
    decided: list[tuple[ReturnOutcome, float]] = []

    async def main() -> None:
        base = trio.current_time()
        deadline = base + DEADLINE_S
        done = trio.Event()
        result = CallReturn()

        async def aborter() -> None:
            if lands_at is None:
                await trio.sleep_forever()
            await trio.sleep_until(base + lands_at)
            # Each hop: one more task between "the thread came back" and the event.
            for _ in range(hops):
                relay = trio.Event()

                async def hop(event: trio.Event = relay) -> None:
                    event.set()

                nursery.start_soon(hop)
                await relay.wait()
            if error:
                result.error = CommError("ncclCommAbort failed")
            result.finished_at = trio.current_time()
            done.set()

        async def waiter() -> None:
            outcome = await wait_for_return(done, result, deadline)
            decided.append((outcome, trio.current_time() - base))
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            if aborter_first:
                nursery.start_soon(aborter)
                nursery.start_soon(waiter)
            else:
                nursery.start_soon(waiter)
                nursery.start_soon(aborter)

    with trio_seed(seed):
        trio.run(main, clock=clock)
    assert len(decided) == 1
    return decided[0]


def scenarios() -> Iterator[dict[str, object]]:
    for i in range(REPEATS):
        yield {"seed": i, "hops": i % 4, "aborter_first": i % 2 == 0}


def test_abort_returning_is_returned() -> None:
    for kw in scenarios():
        outcome, at = decide(lands_at=1.5, **kw)  # type: ignore[arg-type]
        assert (outcome, at) == ("returned", 1.5), kw


def test_abort_never_returning_is_deadline_at_the_deadline() -> None:
    for kw in scenarios():
        outcome, at = decide(lands_at=None, **kw)  # type: ignore[arg-type]
        assert (outcome, at) == ("deadline", DEADLINE_S), kw


def test_abort_an_instant_before_the_deadline_is_a_recovery() -> None:
    for kw in scenarios():
        outcome, at = decide(lands_at=DEADLINE_S - 1e-9, **kw)  # type: ignore[arg-type]
        assert outcome == "returned", kw
        assert at <= DEADLINE_S


def test_abort_exactly_at_the_deadline_is_a_recovery() -> None:
    for kw in scenarios():
        outcome, at = decide(lands_at=DEADLINE_S, **kw)  # type: ignore[arg-type]
        assert (outcome, at) == ("returned", DEADLINE_S), kw


def test_abort_returning_an_error_came_back() -> None:
    for kw in scenarios():
        assert decide(lands_at=3.0, error=True, **kw)[0] == "error", kw  # type: ignore[arg-type]
        # ... also when the error lands exactly at the deadline
        assert decide(lands_at=DEADLINE_S, error=True, **kw)[0] == "error", kw  # type: ignore[arg-type]


def test_abort_after_the_deadline_is_deadline() -> None:
    for kw in scenarios():
        outcome, at = decide(lands_at=DEADLINE_S + 1e-6, **kw)  # type: ignore[arg-type]
        assert (outcome, at) == ("deadline", DEADLINE_S), kw


def test_abort_already_back_before_waiting() -> None:
    async def main() -> ReturnOutcome:
        done = trio.Event()
        done.set()
        return await wait_for_return(done, CallReturn(), trio.current_time() - 1.0)

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == "returned"


@pytest.mark.parametrize("rounds", [0])
def test_without_the_recheck_the_exact_instant_would_depend_on_scheduling(
    monkeypatch: pytest.MonkeyPatch, rounds: int
) -> None:
    """The guard against a vacuous test: with the re-check disabled, the same scenarios
    give "deadline" in some runs (trio's order decides), which the re-check removes."""
    import neuron_trio.service.wedge.threads as threads

    monkeypatch.setattr(threads, "_SAME_INSTANT_ROUNDS", rounds)
    outcomes = {decide(lands_at=DEADLINE_S, **kw)[0] for kw in scenarios()}  # type: ignore[arg-type]
    assert outcomes == {"returned", "deadline"}
