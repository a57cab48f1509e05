"""GPU discovery and live reads through NVML (the `pynvml` module of nvidia-ml-py).

A sick GPU can hang NVML, so no NVML call runs on a caller's thread: every read runs on a
worker thread and is waited for with a timeout. A read that does not come back in time is
reported as a snapshot with `error = "timed out after 2s"`, never raised. A machine without
a driver or without GPUs gets a snapshot with `available = False` and the reason.

Layers: `NvmlProbe` does the reads (sync `read_sync`, async `read`); `GpuActor` is the trio
actor that keeps a cached snapshot for `/metrics` and offers a fresh bounded read (`live`).
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from types import ModuleType
from typing import Any, Protocol, TypeVar

import trio

log = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_S = 2.0
DEFAULT_REFRESH_INTERVAL_S = 10.0
# Threads that may sit blocked in NVML at once, per probe. Past this, a read fails at once
# ("busy") instead of piling up threads on a hung driver.
MAX_BLOCKED_THREADS = 2

T = TypeVar("T")


@dataclass(frozen=True)
class GpuReading:
    """One GPU, as NVML saw it. A field NVML does not support on this GPU is None."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    error: str | None = None  # a per-GPU failure (the rest of the node still reads)


@dataclass(frozen=True)
class GpuSnapshot:
    """What NVML saw at `read_at` (unix seconds).

    `available` is False when there is no driver, no GPU, or the read failed; `reason` says
    which. `error` is set only for a failed or timed-out read (the GPUs may well exist).
    """

    available: bool
    gpus: tuple[GpuReading, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    reason: str | None = None
    error: str | None = None
    read_at: float = field(default_factory=time.time)

    @property
    def timed_out(self) -> bool:
        return self.error is not None and self.error.startswith("timed out")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpus"] = [asdict(g) for g in self.gpus]
        for key in ("reason", "error"):
            if data[key] is None:
                del data[key]
        return data


def _failed(error: str) -> GpuSnapshot:
    return GpuSnapshot(available=False, reason=error, error=error)


def _timed_out(timeout_s: float) -> GpuSnapshot:
    return _failed(f"timed out after {timeout_s:g}s")


class GpuProbe(Protocol):
    """Reads the GPUs. Both calls are bounded by `timeout_s` and never raise."""

    def read_sync(self, timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> GpuSnapshot: ...

    async def read(self, timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> GpuSnapshot: ...


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlProbe:
    """`GpuProbe` over pynvml. `module` replaces pynvml (tests pass a fake).

    NVML is initialised once, on the first read (on a worker thread, bounded like a read).
    A failed init (no library, no driver) is remembered: every later read says the same.

    Cancellation handling: `read` runs NVML on a thread with `abandon_on_cancel=True` under
    its own `CapacityLimiter`; a timed-out or cancelled read abandons the thread, which
    keeps its limiter slot until NVML returns. With every slot held by hung threads, further
    reads time out waiting for a slot: they never start yet another thread. `read_sync`
    does the same with plain daemon threads and a counter.
    """

    def __init__(self, module: ModuleType | None = None) -> None:
        self._module = module
        self._init_lock = threading.Lock()
        self._init_state: str | None = None  # None: not tried; "": ok; else the reason
        self._limiter = trio.CapacityLimiter(MAX_BLOCKED_THREADS)
        self._sync_lock = threading.Lock()
        self._sync_busy = 0

    # --- the blocking part, always on a worker thread -------------------------------------

    def _nvml(self) -> ModuleType:
        if self._module is None:
            self._module = importlib.import_module("pynvml")
        return self._module

    def _ensure_init(self) -> str:
        """Initialise NVML once; return "" when ready, else why not."""
        with self._init_lock:
            if self._init_state is None:
                try:
                    self._nvml().nvmlInit()
                    self._init_state = ""
                except ImportError as exc:
                    self._init_state = f"nvidia-ml-py is not installed: {exc}"
                except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, …
                    self._init_state = f"NVML unavailable: {exc}"
            return self._init_state

    def read_blocking(self) -> GpuSnapshot:
        """One full read on the calling thread. Unbounded: call it through `read`/`read_sync`."""
        reason = self._ensure_init()
        if reason:
            return GpuSnapshot(available=False, reason=reason)
        nvml = self._nvml()
        try:
            driver = _decode(nvml.nvmlSystemGetDriverVersion())
            cuda = _cuda_version(nvml)
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:
            return _failed(f"NVML read failed: {exc}")
        gpus = tuple(self._read_gpu(nvml, i) for i in range(count))
        if not gpus:
            return GpuSnapshot(
                available=False,
                driver_version=driver,
                cuda_version=cuda,
                reason=f"no NVIDIA GPU found (driver {driver})",
            )
        return GpuSnapshot(available=True, gpus=gpus, driver_version=driver, cuda_version=cuda)

    @staticmethod
    def _read_gpu(nvml: ModuleType, index: int) -> GpuReading:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            reading = GpuReading(
                index=index,
                uuid=_decode(nvml.nvmlDeviceGetUUID(handle)),
                name=_decode(nvml.nvmlDeviceGetName(handle)),
                pci_bus_id=_decode(nvml.nvmlDeviceGetPciInfo(handle).busId),
                memory_total_bytes=int(memory.total),
                memory_used_bytes=int(memory.used),
                memory_free_bytes=int(memory.free),
            )
        except Exception as exc:
            return GpuReading(
                index=index,
                uuid="",
                name="",
                pci_bus_id="",
                memory_total_bytes=0,
                memory_used_bytes=0,
                memory_free_bytes=0,
                error=f"NVML read of GPU {index} failed: {exc}",
            )
        # Optional fields: some GPUs (and vGPUs) do not support them.
        util = _optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        temperature = _optional(
            lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
        )
        power_mw = _optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        return replace(
            reading,
            utilization_gpu_pct=None if util is None else int(util.gpu),
            utilization_memory_pct=None if util is None else int(util.memory),
            temperature_c=None if temperature is None else int(temperature),
            power_w=None if power_mw is None else round(int(power_mw) / 1000.0, 3),
        )

    # --- bounded entry points ---------------------------------------------------------------

    def read_sync(self, timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> GpuSnapshot:
        """A read from synchronous code (CLI, forensics): at most `timeout_s`, never raises."""
        with self._sync_lock:
            if self._sync_busy >= MAX_BLOCKED_THREADS:
                return _failed(f"NVML busy: {self._sync_busy} earlier reads are still blocked")
            self._sync_busy += 1
        result: list[GpuSnapshot] = []
        done = threading.Event()

        def work() -> None:
            try:
                result.append(self._guarded())
            finally:
                with self._sync_lock:
                    self._sync_busy -= 1
                done.set()

        # A daemon thread: a read hung in the driver must not hold up interpreter exit.
        threading.Thread(target=work, name="nvml-read", daemon=True).start()
        if not done.wait(timeout_s):
            return _timed_out(timeout_s)
        return result[0]

    async def read(self, timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> GpuSnapshot:
        """A read from trio: at most `timeout_s` (waiting for a free slot included)."""
        with trio.move_on_after(timeout_s):
            return await trio.to_thread.run_sync(
                self._guarded,
                abandon_on_cancel=True,
                limiter=self._limiter,
                thread_name="nvml-read",
            )
        return _timed_out(timeout_s)

    def _guarded(self) -> GpuSnapshot:
        try:
            return self.read_blocking()
        except Exception as exc:  # a bug or a very odd driver: still a snapshot, not a crash
            return _failed(f"NVML read failed: {exc!r}")


def _optional(call: Callable[[], T]) -> T | None:
    try:
        return call()
    except Exception:
        return None


def _cuda_version(nvml: ModuleType) -> str | None:
    """The CUDA version the driver supports, e.g. 12040 -> "12.4"."""
    raw = _optional(nvml.nvmlSystemGetCudaDriverVersion)
    if raw is None:
        return None
    value = int(raw)
    return f"{value // 1000}.{(value % 1000) // 10}"
