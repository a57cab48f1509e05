"""Prometheus gauges for the GPUs, read from the GPU actor's cached snapshot at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from neuron_trio.gpu.nvml import GpuSnapshot


class HasSnapshot(Protocol):
    @property
    def snapshot(self) -> GpuSnapshot: ...


class GpuCollector(Collector):
    """`registry.register(GpuCollector(gpu_actor))`: a scrape never calls NVML itself."""

    def __init__(self, source: HasSnapshot) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        snap = self.source.snapshot
        labels = ["gpu", "uuid", "name"]
        available = GaugeMetricFamily(
            "neuron_gpu_available", "1 when NVML reads GPUs, 0 without a driver or GPU"
        )
        available.add_metric([], 1.0 if snap.available else 0.0)
        age = GaugeMetricFamily(
            "neuron_gpu_snapshot_timestamp_seconds", "When the GPU snapshot was read (unix time)"
        )
        age.add_metric([], snap.read_at)
        used = GaugeMetricFamily("neuron_gpu_memory_used_bytes", "GPU memory in use", labels=labels)
        total = GaugeMetricFamily("neuron_gpu_memory_total_bytes", "GPU memory", labels=labels)
        util = GaugeMetricFamily(
            "neuron_gpu_utilization_ratio", "GPU busy fraction over the last sample", labels=labels
        )
        mem_util = GaugeMetricFamily(
            "neuron_gpu_memory_utilization_ratio", "GPU memory bus busy fraction", labels=labels
        )
        temp = GaugeMetricFamily("neuron_gpu_temperature_celsius", "GPU temperature", labels=labels)
        power = GaugeMetricFamily("neuron_gpu_power_watts", "GPU power draw", labels=labels)
        for g in snap.gpus:
            if g.error:
                continue
            values = [str(g.index), g.uuid, g.name]
            used.add_metric(values, float(g.memory_used_bytes))
            total.add_metric(values, float(g.memory_total_bytes))
            if g.utilization_gpu_pct is not None:
                util.add_metric(values, g.utilization_gpu_pct / 100.0)
            if g.utilization_memory_pct is not None:
                mem_util.add_metric(values, g.utilization_memory_pct / 100.0)
            if g.temperature_c is not None:
                temp.add_metric(values, float(g.temperature_c))
            if g.power_w is not None:
                power.add_metric(values, g.power_w)
        yield from (available, age, used, total, util, mem_util, temp, power)
