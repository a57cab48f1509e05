"""NvmlProbe and GpuActor against a fake pynvml: reads, no driver, a hanging call."""

from __future__ import annotations

import json
import threading

import pytest
import trio
import trio.testing

from neuron_trio.gpu import nvml as nvml_mod
from neuron_trio.gpu.actor import GpuActor
from neuron_trio.gpu.nvml import GpuSnapshot, NvmlProbe
from tests.gpu.fake_nvml import FakeNvml


def test_reads_every_field() -> None:
    snap = NvmlProbe(FakeNvml()).read_sync(5)  # type: ignore[arg-type]
    assert snap.available and snap.error is None
    assert snap.driver_version == "550.54.15" and snap.cuda_version == "12.4"
    first = snap.gpus[0]
    assert first.index == 0 and first.uuid == "GPU-00000000" and first.name == "NVIDIA H200"
    assert first.pci_bus_id == "00000000:18:00.0"
    assert first.memory_total_bytes == first.memory_used_bytes + first.memory_free_bytes
    assert (first.utilization_gpu_pct, first.utilization_memory_pct) == (40, 7)
    assert first.temperature_c == 41 and first.power_w == 123.456
    assert [g.index for g in snap.gpus] == [0, 1]
    doc = json.loads(json.dumps(snap.to_dict()))
    assert doc["available"] is True and "error" not in doc and len(doc["gpus"]) == 2


def test_unsupported_fields_are_none() -> None:
    fake = FakeNvml(1)
    fake.unsupported = {"util", "power"}
    gpu = NvmlProbe(fake).read_sync(5).gpus[0]  # type: ignore[arg-type]
    assert gpu.utilization_gpu_pct is None and gpu.power_w is None and gpu.temperature_c == 41


def test_no_driver_is_a_snapshot_and_init_runs_once() -> None:
    fake = FakeNvml(init_error="Driver Not Loaded")
    probe = NvmlProbe(fake)  # type: ignore[arg-type]
    first = probe.read_sync(5)
    second = probe.read_sync(5)
    assert not first.available and first.error is None
    assert "Driver Not Loaded" in (first.reason or "") and second.reason == first.reason
    assert fake.init_calls == 1


def test_no_gpu_says_so() -> None:
    snap = NvmlProbe(FakeNvml(0)).read_sync(5)  # type: ignore[arg-type]
    assert not snap.available and "no NVIDIA GPU" in (snap.reason or "")


def test_real_pynvml_without_a_driver_does_not_raise() -> None:
    snap = NvmlProbe().read_sync(10)
    assert isinstance(snap, GpuSnapshot)


def test_hanging_sync_read_times_out_and_threads_are_bounded() -> None:
    fake = FakeNvml()
    fake.hang = threading.Event()
    probe = NvmlProbe(fake)  # type: ignore[arg-type]
    try:
        snap = probe.read_sync(0.05)
        assert snap.error == "timed out after 0.05s" and snap.timed_out and not snap.available
        assert snap.to_dict()["error"] == "timed out after 0.05s"
        probe.read_sync(0.01)
        # Both slots are held by blocked threads: the third read fails at once.
        busy = probe.read_sync(60)
        assert busy.error is not None and "busy" in busy.error
    finally:
        fake.hang.set()


def test_hanging_async_read_times_out() -> None:
    trio.run(_hanging_async_read_times_out)


async def _hanging_async_read_times_out() -> None:
    fake = FakeNvml()
    fake.hang = threading.Event()
    probe = NvmlProbe(fake)  # type: ignore[arg-type]
    try:
        # A real (short) timeout: the thread is real, so MockClock cannot drive it.
        snap = await probe.read(0.05)
        assert snap.error == "timed out after 0.05s"
    finally:
        fake.hang.set()
    fake.hang = None
    assert (await probe.read(5)).available


class ScriptedProbe:
    """A trio-native probe: returns queued snapshots, for the actor's decisions."""

    def __init__(self, *snaps: GpuSnapshot) -> None:
        self.snaps = list(snaps)
        self.reads = 0

    def read_sync(self, timeout_s: float = 2.0) -> GpuSnapshot:
        raise AssertionError("the actor reads asynchronously")

    async def read(self, timeout_s: float = 2.0) -> GpuSnapshot:
        self.reads += 1
        return self.snaps.pop(0) if len(self.snaps) > 1 else self.snaps[0]


def _good(used: int) -> GpuSnapshot:
    snap = NvmlProbe(FakeNvml(1)).read_sync(5)  # type: ignore[arg-type]
    gpu = nvml_mod.replace(snap.gpus[0], memory_used_bytes=used)
    return nvml_mod.replace(snap, gpus=(gpu,))


def test_actor_refreshes_on_its_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = trio.testing.MockClock()
    trio.run(_actor_refreshes, clock, clock=clock)
    assert "timed out after 2s" in caplog.text


async def _actor_refreshes(clock: trio.testing.MockClock) -> None:
    timed_out = nvml_mod._timed_out(2.0)
    probe = ScriptedProbe(_good(1), _good(2), timed_out, _good(3))
    actor = GpuActor(probe, refresh_interval_s=10)
    async with trio.open_nursery() as nursery:
        started = await nursery.start(actor.run)
        assert started is actor and actor.snapshot.gpus[0].memory_used_bytes == 1
        clock.jump(10)
        await trio.testing.wait_all_tasks_blocked()
        assert actor.snapshot.gpus[0].memory_used_bytes == 2
        clock.jump(10)
        await trio.testing.wait_all_tasks_blocked()
        # A timed-out refresh keeps the last good snapshot for the gauges, and is counted.
        assert actor.snapshot.gpus[0].memory_used_bytes == 2
        assert actor.statistics().timed_out_reads == 1
        clock.jump(10)
        await trio.testing.wait_all_tasks_blocked()
        assert actor.snapshot.gpus[0].memory_used_bytes == 3
        live = await actor.live()
        assert live.available
        nursery.cancel_scope.cancel()


def test_actor_without_gpu_logs_once_and_stops_reading(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    clock = trio.testing.MockClock()
    trio.run(_actor_without_gpu, clock, clock=clock)
    assert caplog.text.count("no GPU/driver: running on the CPU") == 1


async def _actor_without_gpu(clock: trio.testing.MockClock) -> None:
    probe = ScriptedProbe(GpuSnapshot(available=False, reason="NVML unavailable: no library"))
    actor = GpuActor(probe, refresh_interval_s=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        clock.jump(100)
        await trio.testing.wait_all_tasks_blocked()
        assert actor.cpu_only and probe.reads == 1
        assert not (await actor.live()).available and probe.reads == 1
        nursery.cancel_scope.cancel()


def test_gpu_collector() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from neuron_trio.gpu.metrics import GpuCollector

    class Source:
        snapshot = NvmlProbe(FakeNvml(2)).read_sync(5)  # type: ignore[arg-type]

    registry = CollectorRegistry()
    registry.register(GpuCollector(Source()))
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    used = families["neuron_gpu_memory_used_bytes"].samples
    assert [(s.labels["gpu"], s.value) for s in used] == [("0", 2.0**30), ("1", 2.0 * 2**30)]
    assert families["neuron_gpu_available"].samples[0].value == 1.0
    assert families["neuron_gpu_utilization_ratio"].samples[0].value == 0.4
