"""A stand-in for the `pynvml` module: two GPUs, with hooks to fail or hang a call."""

from __future__ import annotations

import threading
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class FakeNvml:
    NVML_TEMPERATURE_GPU = 0
    NVMLError = NVMLError

    def __init__(self, count: int = 2, *, init_error: str | None = None) -> None:
        self.count = count
        self.init_error = init_error
        self.init_calls = 0
        self.hang: threading.Event | None = None  # set: nvmlDeviceGetCount blocks on it
        self.entered = threading.Event()
        self.unsupported: set[str] = set()

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlDeviceGetCount(self) -> int:
        if self.hang is not None:
            self.entered.set()
            self.hang.wait()
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-{handle:08d}".encode()

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=f"00000000:{handle + 0x18:02X}:00.0")

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        total = 141 * 2**30
        used = (handle + 1) * 2**30
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        if "util" in self.unsupported:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=40 + handle, memory=7)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 41

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if "power" in self.unsupported:
            raise NVMLError("Not Supported")
        return 123456
