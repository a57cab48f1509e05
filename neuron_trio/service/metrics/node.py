"""Series about the node itself that stay readable across process lives.

A process that dies takes its counters with it, so restarts and deadman exits are exported
from what the state directory remembers:

- `neuron_node_starts_total`: starts recorded in `state_dir` (the `starts` of `/health`);
  it never resets with the process, so `max_over_time - min_over_time` over a window is the
  number of restarts in it, even when the short lives in between were never scraped;
- `neuron_node_start_time_seconds`: when this process started (unix time);
- `neuron_node_info{boot_id,hostname,version}`: 1; the boot id changes on every start;
- `neuron_node_status{status}`: 1 for the `/health` status now (ok, starting, ...);
- `neuron_node_last_forensics_timestamp_seconds`: when the newest forensics report (written
  just before a deadman exit 70) was written, 0 when there is none;
- `neuron_node_previous_stop_clean`: 0 when the process before this one did not stop cleanly
  (crash, kill, OOM, exit 70, failed start), 1 otherwise (a drain that ended in exit 0).

Read at scrape time from the node (no state of its own), like the model gauges.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import trio
from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

HEALTH_STATUSES = ("ok", "starting", "draining", "recovering", "wedged")


@dataclass(frozen=True)
class NodeStatistics:
    """What the node collector exports (cheap: no I/O)."""

    boot_id: str
    hostname: str
    version: str
    starts: int
    started_at_unix: float
    status: str
    last_forensics_unix: float | None
    previous_stop_clean: bool = True


class HasNodeStatistics(Protocol):
    def node_statistics(self) -> NodeStatistics: ...


class NodeCollector(Collector):
    """`registry.register(NodeCollector(node))`."""

    def __init__(self, source: HasNodeStatistics) -> None:
        self._source = source

    def describe(self) -> Iterable[Metric]:
        return []  # read at scrape time

    def collect(self) -> Iterator[Metric]:
        s = self._source.node_statistics()
        starts = CounterMetricFamily(
            "neuron_node_starts",
            "Starts recorded in the state directory, this one included (survives restarts)",
        )
        starts.add_metric([], float(s.starts))
        started = GaugeMetricFamily(
            "neuron_node_start_time_seconds", "When this process started (unix time)"
        )
        started.add_metric([], s.started_at_unix)
        info = GaugeMetricFamily(
            "neuron_node_info",
            "This process (value 1); boot_id is new on every start",
            labels=["boot_id", "hostname", "version"],
        )
        info.add_metric([s.boot_id, s.hostname, s.version], 1.0)
        status = GaugeMetricFamily(
            "neuron_node_status", "1 for the node's /health status now", labels=["status"]
        )
        for name in HEALTH_STATUSES:
            status.add_metric([name], 1.0 if s.status == name else 0.0)
        forensics = GaugeMetricFamily(
            "neuron_node_last_forensics_timestamp_seconds",
            "When the newest forensics report (a deadman exit 70) was written; 0: none",
        )
        forensics.add_metric([], s.last_forensics_unix or 0.0)
        clean = GaugeMetricFamily(
            "neuron_node_previous_stop_clean",
            "0 when the process before this one did not stop cleanly (crash, kill, exit 70)",
        )
        clean.add_metric([], 1.0 if s.previous_stop_clean else 0.0)
        yield from (starts, started, info, status, forensics, clean)


class RateWindow:
    """The rate of a counter over the last `window_s`, from samples taken every few seconds.

    For "tokens/s over the last minute" in `/v1/node` (and `neuron status`), which a single
    read of a counter cannot give. Bounded: samples older than the window are dropped.
    """

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, at: float, value: float) -> None:
        if self._samples and value < self._samples[-1][1]:
            self._samples.clear()  # the counter was reset (the model was reloaded)
        self._samples.append((at, value))
        # Keep one sample at or before the window's start, so the rate spans the whole window.
        while len(self._samples) > 2 and self._samples[1][0] <= at - self.window_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        """Per second, between the oldest sample in the window and the newest; None before two."""
        if len(self._samples) < 2:
            return None
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else None


TOKEN_RATE_SAMPLE_S = 5.0  # how often each model's generated tokens are sampled (tokens/s, 1 min)


class TokenRates:
    """Each model's generated tokens per second over the last minute (`/v1/node`), from its
    `neuron_model_generated_tokens` counter sampled every TOKEN_RATE_SAMPLE_S by `run`."""

    def __init__(self, generated_tokens: Counter) -> None:
        self._counter = generated_tokens
        self._windows: dict[str, RateWindow] = {}

    async def run(self, models: Callable[[], Iterable[str]]) -> None:
        """Sample the counter for each of `models()` into its window, for ever; a model no
        longer listed loses its window."""
        while True:
            now = trio.current_time()
            totals = {
                sample.labels["model"]: sample.value
                for family in self._counter.collect()
                for sample in family.samples
                if sample.name.endswith("_total")
            }
            names = set(models())
            for name in names:
                self._windows.setdefault(name, RateWindow()).add(now, totals.get(name, 0.0))
            for gone in set(self._windows) - names:
                del self._windows[gone]
            await trio.sleep(TOKEN_RATE_SAMPLE_S)

    def rate(self, model: str) -> float | None:
        """Tokens/s over the last minute, rounded; None before two samples."""
        window = self._windows.get(model)
        rate = window.rate() if window is not None else None
        return round(rate, 2) if rate is not None else None
