"""Prometheus series of the wedge watchdog, one set per registry (shared by every model).

Alert on: `increase(neuron_watchdog_wedges_total[10m]) > 0`,
`neuron_watchdog_aborts_total{outcome="deadline"}` (that process then exited 70),
`neuron_watchdog_recovering == 1` for longer than the abort deadline.
"""

from __future__ import annotations

import threading
import weakref
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_ABORT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)
ABORT_OUTCOMES = ("returned", "error", "deadline")
PROBE_RESULTS = ("ok", "error", "timeout")


class WatchdogMetrics:
    """The watchdog's collectors. Get them with `WatchdogMetrics.for_registry(registry)`:
    creating a second set on the same registry would be a duplicate registration."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, WatchdogMetrics]] = (
        weakref.WeakKeyDictionary()
    )
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.wedges = Counter(
            "neuron_watchdog_wedges_total",
            "Engine steps (or probes) that ran past watchdog.step_timeout_s.",
            ["model", "what"],
            registry=registry,
        )
        self.aborts = Counter(
            "neuron_watchdog_aborts_total",
            "Communicator aborts after a wedge, by outcome (returned, error, deadline).",
            ["model", "outcome"],
            registry=registry,
        )
        self.abort_seconds = Histogram(
            "neuron_watchdog_abort_duration_seconds",
            "How long a communicator abort took (up to the deadline, when it never returned).",
            ["model", "outcome"],
            buckets=_ABORT_BUCKETS,
            registry=registry,
        )
        self.recoveries = Counter(
            "neuron_watchdog_recoveries_total",
            "Wedges that ended with the model serving again.",
            ["model"],
            registry=registry,
        )
        self.recovering = Gauge(
            "neuron_watchdog_recovering",
            "1 while the model is recovering from a wedge (aborting, re-creating, probing).",
            ["model"],
            registry=registry,
        )
        self.probes = Counter(
            "neuron_watchdog_idle_probes_total",
            "Idle probe steps run, by result (ok, failed, wedged).",
            ["model", "result"],
            registry=registry,
        )

    def zero(self, model: str, wedge_kinds: tuple[str, ...] = ("step", "probe")) -> None:
        """Export every counter of `model` at 0 from its load on.

        A labelled counter has no series until its first increment, and Prometheus's
        `increase()` needs two samples: the first wedge of a process would be invisible to
        `increase(neuron_watchdog_wedges_total[10m]) > 0` without a 0 before it.
        """
        for what in wedge_kinds:
            self.wedges.labels(model, what)
        for outcome in ABORT_OUTCOMES:
            self.aborts.labels(model, outcome)
        self.recoveries.labels(model)
        for result in PROBE_RESULTS:
            self.probes.labels(model, result)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> WatchdogMetrics:
        with cls._lock:
            metrics = cls._by_registry.get(registry)
            if metrics is None:
                metrics = cls._by_registry[registry] = cls(registry)
            return metrics
