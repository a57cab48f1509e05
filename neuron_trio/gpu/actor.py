"""The GPU actor: NVML discovery at start, a cached snapshot for `/metrics`, live reads."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from neuron_trio.gpu.nvml import (
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_REFRESH_INTERVAL_S,
    GpuProbe,
    GpuSnapshot,
    NvmlProbe,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuActorStatistics:
    refreshes: int
    timed_out_reads: int
    last_read_at: float | None
    gpus: int
    available: bool


class GpuActor:
    """Owns the node's view of its GPUs.

    `run` reads once (discovery), reports started with itself, then refreshes the cached
    `snapshot` every `refresh_interval_s` (the gauges of `/metrics` read it). Without a
    driver or GPUs it says so once ("running on the CPU") and stops refreshing. `live()` is a
    fresh bounded read for `/v1/node` and placement: never the cache, which the machinery
    under suspicion refreshes.
    """

    def __init__(
        self,
        probe: GpuProbe | None = None,
        *,
        refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        self.probe: GpuProbe = probe if probe is not None else NvmlProbe()
        self.refresh_interval_s = refresh_interval_s
        self.read_timeout_s = read_timeout_s
        self._snapshot: GpuSnapshot | None = None
        self._refreshes = 0
        self._timed_out = 0
        self._no_gpu = False
        self._warned_timeout = False

    @property
    def snapshot(self) -> GpuSnapshot:
        """The cached snapshot (before `run` has read once: unavailable, "not read yet")."""
        return self._snapshot or GpuSnapshot(available=False, reason="not read yet", read_at=0.0)

    @property
    def cpu_only(self) -> bool:
        """True once discovery found no driver or no GPU: the node runs on the CPU."""
        return self._no_gpu

    def statistics(self) -> GpuActorStatistics:
        snap = self._snapshot
        return GpuActorStatistics(
            refreshes=self._refreshes,
            timed_out_reads=self._timed_out,
            last_read_at=None if snap is None else snap.read_at,
            gpus=0 if snap is None else len(snap.gpus),
            available=bool(snap and snap.available),
        )

    async def live(self, timeout_s: float | None = None) -> GpuSnapshot:
        """A fresh read, bounded by `timeout_s` (default: the actor's read timeout)."""
        if self._no_gpu:
            return self.snapshot
        snap = await self.probe.read(self.read_timeout_s if timeout_s is None else timeout_s)
        self._note(snap)
        return snap

    async def refresh(self) -> GpuSnapshot:
        snap = await self.probe.read(self.read_timeout_s)
        self._refreshes += 1
        self._note(snap)
        # Keep the cache on the last snapshot that was read, and a failure only when there
        # was never a good one: a gauge from 10 s ago beats none while NVML stalls.
        if snap.error is None or self._snapshot is None or self._snapshot.error is not None:
            self._snapshot = snap
        return snap

    def _note(self, snap: GpuSnapshot) -> None:
        if snap.timed_out:
            self._timed_out += 1
            if not self._warned_timeout:
                log.warning("NVML read %s (a sick GPU can hang NVML)", snap.error)
                self._warned_timeout = True
        elif snap.error is None:
            self._warned_timeout = False

    async def run(
        self, *, task_status: trio.TaskStatus[GpuActor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        snap = await self.refresh()
        if not snap.available and snap.error is None:
            self._no_gpu = True
            log.info("no GPU/driver: running on the CPU (%s)", snap.reason)
        else:
            for gpu in snap.gpus:
                log.info(
                    "GPU %d: %s %s, %.1f GiB, bus %s",
                    gpu.index,
                    gpu.name,
                    gpu.uuid,
                    gpu.memory_total_bytes / 2**30,
                    gpu.pci_bus_id,
                )
            if snap.available:
                log.info("NVIDIA driver %s, CUDA %s", snap.driver_version, snap.cuda_version)
        task_status.started(self)
        if self._no_gpu:
            await trio.sleep_forever()
        while True:
            await trio.sleep(self.refresh_interval_s)
            await self.refresh()
