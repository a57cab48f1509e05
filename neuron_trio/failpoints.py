"""Fault injection for drills: `NEURON_FAILPOINTS="tp.allreduce=hang;tp.abort=sleep(5)"`.

A failpoint is armed once the daemon is about to answer `/health` 200 (loading and warm-up
are never affected) and fires once, the first time it is reached after that. This module is
plain threading code: failpoints are reached on worker threads (engine steps, NCCL calls).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass

from neuron_trio.errors import ConfigError, FailpointError

log = logging.getLogger(__name__)

NAMES = ("tp.allreduce", "tp.abort", "engine.step")
ENV_VAR = "NEURON_FAILPOINTS"
_SLEEP_RE = re.compile(r"^sleep\(\s*([0-9]*\.?[0-9]+)\s*\)$")


@dataclass(frozen=True)
class Action:
    kind: str  # "hang" | "sleep" | "error"
    seconds: float = 0.0

    def __str__(self) -> str:
        return f"sleep({self.seconds:g})" if self.kind == "sleep" else self.kind


def parse(spec: str) -> dict[str, Action]:
    """Parse `name=action;…`; raise ConfigError naming the bad entry."""
    actions: dict[str, Action] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        name, sep, action = (s.strip() for s in entry.partition("="))
        if not sep or name not in NAMES:
            raise ConfigError(f"{ENV_VAR}: {entry!r}: expected NAME=ACTION with NAME in {NAMES}")
        if action in ("hang", "error"):
            actions[name] = Action(action)
        elif match := _SLEEP_RE.match(action):
            actions[name] = Action("sleep", float(match[1]))
        else:
            raise ConfigError(f"{ENV_VAR}: {entry!r}: action must be hang, error or sleep(SECONDS)")
    return actions


class Failpoints:
    """The process's failpoints: configured at start, armed before serving, each fired once."""

    def __init__(self, actions: dict[str, Action] | None = None) -> None:
        self._lock = threading.Lock()
        self._actions = dict(actions or {})
        self._armed = False
        self.fired: list[str] = []

    @property
    def configured(self) -> dict[str, Action]:
        return dict(self._actions)

    def configure(self, actions: dict[str, Action]) -> None:
        with self._lock:
            self._actions = dict(actions)
            self._armed = False
            self.fired = []

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def take(self, name: str) -> Action | None:
        """The action for `name` if armed and not yet fired; marks it fired."""
        with self._lock:
            if not self._armed or name not in self._actions:
                return None
            self.fired.append(name)
            return self._actions.pop(name)

    def reach(self, name: str, *, until: threading.Event | None = None) -> None:
        """Run the failpoint `name` if it is due, on the calling (worker) thread.

        `hang` blocks until `until` is set (a communicator's abort), or forever without one;
        `sleep(S)` waits S seconds, then returns so the caller does the real work;
        `error` raises FailpointError.
        """
        action = self.take(name)
        if action is None:
            return
        # Drills (bench/router_drill.py) date the fault from this line.
        log.warning("failpoint %s fired: %s", name, action)
        if action.kind == "error":
            raise FailpointError(f"failpoint {name}=error")
        if action.kind == "sleep":
            time.sleep(action.seconds)
            return
        (until or threading.Event()).wait()


# The process's registry: configured by the daemon from NEURON_FAILPOINTS, never in tests
# that do not ask for it (they build their own Failpoints and pass it in).
REGISTRY = Failpoints()
