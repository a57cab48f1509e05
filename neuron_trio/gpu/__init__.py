"""GPU discovery: NVML reads bounded on threads (`nvml`), the actor (`actor`), nvidia-smi (`smi`)."""

from neuron_trio.gpu.actor import GpuActor, GpuActorStatistics
from neuron_trio.gpu.metrics import GpuCollector
from neuron_trio.gpu.nvml import GpuProbe, GpuReading, GpuSnapshot, NvmlProbe
from neuron_trio.gpu.smi import run_nvidia_smi

__all__ = [
    "GpuActor",
    "GpuActorStatistics",
    "GpuCollector",
    "GpuProbe",
    "GpuReading",
    "GpuSnapshot",
    "NvmlProbe",
    "run_nvidia_smi",
]
