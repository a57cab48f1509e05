"""A model's states, one definition, and its health: the one state machine that holds them.

The actor owns its model's `ModelHealth` and makes the moves of its life (loading, serving,
recovering after a failed or wedged step, unloading); the watchdog reports the one thing only
it knows, that this model's wedge fires the deadman ("wedged"); and since the deadman is shared,
a process ending for another model's wedge reads as "wedged" too. `/v1/node`, `/health` and the
`neuron_model_state` gauge (one series per state) show `ModelHealth.state`.

The watchdog's own state (`wedge.records.WatchdogState`: idle, stepping, probing, recovering,
aborting) is that of its calls, shown under a model's `watchdog`; it is not the model's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Literal, Protocol, get_args

__all__ = ["MODEL_STATES", "MOVES", "HealthReport", "ModelHealth", "ModelState"]

log = logging.getLogger(__name__)

ModelState = Literal["loading", "serving", "recovering", "wedged", "unloading", "unloaded"]
MODEL_STATES: tuple[ModelState, ...] = get_args(ModelState)

# Every move a model's health may make. "wedged" is final (the deadman is firing: the process
# exits 70) and reachable from every other state (the deadman is shared by every model);
# "unloaded" leads nowhere else: a model loaded again gets a new actor.
MOVES: Mapping[ModelState, frozenset[ModelState]] = {
    "loading": frozenset({"serving", "unloaded", "wedged"}),  # loaded and warm / load failed
    "serving": frozenset({"recovering", "unloading", "unloaded", "wedged"}),  # unloaded: cancelled
    "recovering": frozenset({"serving", "unloaded", "wedged"}),  # recovered / cancelled
    "unloading": frozenset({"unloaded", "wedged"}),
    "unloaded": frozenset({"wedged"}),
    "wedged": frozenset(),
}


class HealthReport(Protocol):
    """What the watchdog may do to a model's health: report a move."""

    def move(self, to: ModelState, why: str) -> bool: ...


class ModelHealth:
    """One model's health state, moved on the event loop's thread.

    `process_ending()` (the shared deadman's `firing`) is read with the state: once true, the
    state is "wedged" whatever it was. The deadman's own thread reads `state` too (forensics'
    model states): its only write is that same final "wedged", and once the deadman fires
    every move from the loop is refused, so the two cannot disagree.
    """

    def __init__(
        self,
        model: str,
        *,
        process_ending: Callable[[], bool] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.model = model
        self._state: ModelState = "loading"
        self._process_ending = process_ending
        self._log = logger or log
        self.refused = 0  # moves refused: a bug if ever more than 0

    @property
    def state(self) -> ModelState:
        self._notice_ending()
        return self._state

    def move(self, to: ModelState, why: str) -> bool:
        """Move to `to` (staying put is no move); False if MOVES has no such move: the state
        is left as it was, and the move logged and counted (but out of "wedged": the process
        is ending, and the actor's last moves on its way out are expected)."""
        self._notice_ending()
        current = self._state
        if to == current:
            return True
        if to not in MOVES[current]:
            if current == "wedged":
                self._log.debug("model %s: wedged, not %s (%s)", self.model, to, why)
                return False
            self.refused += 1
            self._log.error("model %s: %s -> %s refused (%s)", self.model, current, to, why)
            return False
        self._state = to
        self._log.debug("model %s: %s -> %s (%s)", self.model, current, to, why)
        return True

    def _notice_ending(self) -> None:
        """The deadman fired (for this model or another): "wedged", from any state."""
        if self._state == "wedged" or self._process_ending is None:
            return
        if self._process_ending():
            self._log.info(
                "model %s: %s -> wedged (the deadman is firing)", self.model, self._state
            )
            self._state = "wedged"
