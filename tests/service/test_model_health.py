"""A model's one health state machine (service/model_state.py): every move MOVES lists is
made, every other one refused (logged, counted), "wedged" final and read from the shared
deadman; and through the actor and its watchdog, a wedge past the abort deadline."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from neuron_trio.config import WatchdogConfig
from neuron_trio.service.model_actor import ModelActor
from neuron_trio.service.model_state import MODEL_STATES, MOVES, ModelHealth, ModelState
from neuron_trio.service.wedge.deadman import DeadmanExit
from neuron_trio.service.wedge.watchdog import Watchdog

from .actor_harness import ABORT_DEADLINE, STEP_TIMEOUT, Harness, job, run_actor, settle, spec
from .fakes import FakeDeadman, FakeExecutor

# How each state is reached from "loading" by listed moves.
REACH: dict[ModelState, list[ModelState]] = {
    "loading": [],
    "serving": ["serving"],
    "recovering": ["serving", "recovering"],
    "unloading": ["serving", "unloading"],
    "unloaded": ["unloaded"],
    "wedged": ["wedged"],
}


def health_in(state: ModelState, **kw: Any) -> ModelHealth:
    health = ModelHealth("m", **kw)
    for step in REACH[state]:
        assert health.move(step, "test")
    assert health.state == state and health.refused == 0
    return health


def test_every_state_has_its_moves_listed() -> None:
    assert set(MOVES) == set(MODEL_STATES) == set(REACH)
    assert MOVES["wedged"] == frozenset()
    assert all("wedged" in MOVES[s] for s in MODEL_STATES if s != "wedged")


@pytest.mark.parametrize(("start", "to"), [(s, t) for s in MOVES for t in MOVES[s]])
def test_each_listed_move_is_made(start: ModelState, to: ModelState) -> None:
    health = health_in(start)
    assert health.move(to, "test") and health.state == to and health.refused == 0


@pytest.mark.parametrize(
    ("start", "to"),
    [(s, t) for s in MOVES if s != "wedged" for t in MODEL_STATES if t != s and t not in MOVES[s]],
)
def test_each_other_move_is_refused_logged_and_counted(
    start: ModelState, to: ModelState, caplog: pytest.LogCaptureFixture
) -> None:
    health = health_in(start)
    with caplog.at_level(logging.ERROR, "neuron_trio.service.model_state"):
        assert not health.move(to, "why not")
    assert health.state == start and health.refused == 1
    assert f"model m: {start} -> {to} refused (why not)" in caplog.text


def test_staying_put_is_no_move() -> None:
    health = health_in("serving")
    assert health.move("serving", "again") and health.refused == 0


@pytest.mark.parametrize("to", [s for s in MODEL_STATES if s != "wedged"])
def test_wedged_is_final(to: ModelState) -> None:
    health = health_in("wedged")
    assert not health.move(to, "the actor on its way out") and health.state == "wedged"
    assert health.refused == 0  # expected while the process ends: not a bug


@pytest.mark.parametrize("start", MODEL_STATES)
def test_the_deadman_firing_for_any_model_reads_as_wedged(start: ModelState) -> None:
    firing = False
    health = health_in(start, process_ending=lambda: firing)
    firing = True
    assert health.state == "wedged"
    assert not health.move("serving", "too late")
    assert health.state == "wedged" and health.refused == 0


def test_a_wedge_past_the_abort_deadline_is_reported_by_the_watchdog(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: dict[str, Any] = {}

    async def test(h: Harness) -> None:
        seen["actor"] = h.actor
        h.threads.hold()  # the step never comes back
        h.consume(job(max_tokens=5))
        await settle()
        h.clock.jump(STEP_TIMEOUT)
        await settle()
        seen["after the step deadline"] = h.actor.state
        h.clock.jump(ABORT_DEADLINE)  # tp = 1: the step itself gets the abort deadline
        await settle()

    logs = caplog.at_level(logging.DEBUG, "neuron_trio.service.model_state")
    with logs, pytest.raises(BaseExceptionGroup) as info:
        run_actor(test)
    assert info.group_contains(DeadmanExit)
    assert seen["after the step deadline"] == "recovering"
    health = seen["actor"].health
    assert health.state == "wedged" and health.refused == 0
    # the watchdog's one report, with its reason, then the actor's way out refused quietly
    assert "recovering -> wedged (watchdog: step-deadline: the step (tp = 1))" in caplog.text
    assert "model m: wedged, not unloaded (stopped)" in caplog.text


def test_an_actor_reads_wedged_once_the_shared_deadman_fires_for_another_model() -> None:
    deadman = FakeDeadman()
    watchdog = Watchdog(model_name="m", deadlines=WatchdogConfig(), deadman=deadman)  # type: ignore[arg-type]
    actor = ModelActor(spec(), lambda: FakeExecutor(2), max_queue=1, watchdog=watchdog)
    assert actor.state == "loading"
    deadman.fired.append({"reason": "model other: step-deadline"})
    assert actor.state == "wedged" and actor.health.refused == 0
