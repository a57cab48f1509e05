"""Where a model goes: `devices = "cpu"`, an explicit GPU list, or `"auto"` by live free memory.

`place` is a pure function of the model entry, its estimated size and a live GPU snapshot
(`gpu.nvml.GpuSnapshot`, read through NVML by the caller), so every decision is unit tested
without a GPU. `estimate_model_bytes` reads a GGUF file's header (blocking: call it on a
worker thread).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from neuron_trio.config import ModelConfig
from neuron_trio.errors import ConfigError, PlacementError
from neuron_trio.executor.api import estimate_gguf_bytes

log = logging.getLogger(__name__)

GIB = 1 << 30
# Room left on each GPU beyond the estimate: CUDA context, allocator fragmentation, activations.
HEADROOM_FRACTION = 0.05
HEADROOM_MIN_BYTES = 512 << 20


class GpuMemoryReading(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def uuid(self) -> str: ...
    @property
    def memory_free_bytes(self) -> int: ...
    @property
    def memory_total_bytes(self) -> int: ...
    @property
    def error(self) -> str | None: ...


class GpuSnapshotLike(Protocol):
    @property
    def available(self) -> bool: ...
    @property
    def gpus(self) -> Sequence[GpuMemoryReading]: ...
    @property
    def reason(self) -> str | None: ...


@dataclass(frozen=True)
class ModelEstimate:
    """Bytes a model needs, in total over all its ranks."""

    weights_bytes: int
    kv_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def headroom(total_bytes: int) -> int:
    return max(HEADROOM_MIN_BYTES, int(total_bytes * HEADROOM_FRACTION))


def cuda_ordinals(gpus: Sequence[GpuMemoryReading], visible: str | None) -> dict[int, int]:
    """NVML index -> CUDA device ordinal, for the GPUs this process's CUDA can see.

    GPU indices everywhere in neuron (config `devices`, `neuron gpus`, placement) are NVML's,
    which count every GPU in PCI bus order. CUDA counts in the same order (the daemon sets
    CUDA_DEVICE_ORDER=PCI_BUS_ID) but only the GPUs in `visible` (CUDA_VISIBLE_DEVICES:
    indices in that order, or UUIDs), renumbered from 0.
    """
    if visible is None:
        return {g.index: g.index for g in gpus}
    by_uuid = {g.uuid: g.index for g in gpus if g.uuid}
    present = {g.index for g in gpus}
    ordinals: dict[int, int] = {}
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            index: int | None = int(entry) if int(entry) in present else None
        else:  # a UUID, possibly abbreviated as CUDA allows ("GPU-8932f937")
            matches = [i for u, i in by_uuid.items() if entry and u.startswith(entry)]
            index = matches[0] if len(matches) == 1 else None
        if index is None or index in ordinals:
            break  # CUDA stops at the first entry it cannot use
        ordinals[index] = len(ordinals)
    return ordinals


def host_memory_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's MemAvailable in bytes (what can be allocated without swapping), or None
    where it cannot be read (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_host_fits(spec: ModelConfig, model_bytes_estimate: int, available: int | None) -> None:
    """PlacementError with the numbers if CPU ranks would need more than MemAvailable.

    Checked before anything is allocated: torch would otherwise ask for it all (a
    max_batch = 256, context = 8192 KV cache is ~96 GB) and fail, or meet the OOM killer.
    """
    if available is None:
        return
    need = model_bytes_estimate + headroom(model_bytes_estimate)
    if need > available:
        raise PlacementError(
            f"model {spec.name!r} needs {_gib(need)} of host memory on the CPU (estimate "
            f"{_gib(model_bytes_estimate)} + headroom; lower max_batch or context); "
            f"{_gib(available)} available (MemAvailable)"
        )


def place(
    spec: ModelConfig,
    model_bytes_estimate: int,
    gpus_snapshot: GpuSnapshotLike | None,
    *,
    cuda_visible_devices: str | None = None,
    host_available_bytes: int | None = None,
) -> list[torch.device]:
    """The `spec.tp` devices (one per rank) for `spec`, or PlacementError with the numbers.

    - `"cpu"`: `tp` CPU ranks, if the estimate fits `host_available_bytes` (MemAvailable)
      plus headroom.
    - a list of GPU indices: those GPUs; each must be present in the snapshot (no fit check:
      the operator chose them, and the allocator will say so if they are full).
    - `"auto"`: the `tp` GPUs with the most free memory, each of which must fit
      `model_bytes_estimate / tp` plus headroom; with no GPU at all, CPU ranks (logged).

    Indices are NVML's; the devices returned carry CUDA's ordinals (`cuda_ordinals`), and
    only GPUs in `cuda_visible_devices` (when set) are used.
    """
    tp = spec.tp
    every_gpu = list(gpus_snapshot.gpus if gpus_snapshot else ())
    ordinal = cuda_ordinals(every_gpu, cuda_visible_devices)  # a GPU NVML cannot read still counts
    gpus = [g for g in every_gpu if not g.error and g.index in ordinal]
    if spec.devices == "cpu":
        _check_host_fits(spec, model_bytes_estimate, host_available_bytes)
        return [torch.device("cpu")] * tp
    if isinstance(spec.devices, list):
        if len(spec.devices) != tp:
            raise PlacementError(
                f"model {spec.name!r}: devices lists {len(spec.devices)} GPUs but tp = {tp}"
            )
        present = {g.index for g in gpus}
        missing = [i for i in spec.devices if i not in present]
        if missing:
            seen = ", ".join(str(i) for i in sorted(present)) or "none"
            if cuda_visible_devices is not None:
                seen += f"; CUDA_VISIBLE_DEVICES={cuda_visible_devices}"
            raise PlacementError(
                f"model {spec.name!r}: GPU(s) {', '.join(map(str, missing))} not found "
                f"(GPUs seen: {seen})"
            )
        return [torch.device("cuda", ordinal[i]) for i in spec.devices]
    # "auto"
    if not gpus:
        why = (gpus_snapshot.reason if gpus_snapshot else None) or "no GPU found"
        log.info("model %s: %s; placing %d rank(s) on the CPU", spec.name, why, tp)
        _check_host_fits(spec, model_bytes_estimate, host_available_bytes)
        return [torch.device("cpu")] * tp
    per_rank = -(-model_bytes_estimate // tp)
    ranked = sorted(gpus, key=lambda g: (-g.memory_free_bytes, g.index))
    fitting = [g for g in ranked if g.memory_free_bytes >= per_rank + headroom(per_rank)]
    if len(fitting) < tp:
        table = "; ".join(f"GPU {g.index}: {_gib(g.memory_free_bytes)} free" for g in ranked)
        raise PlacementError(
            f"model {spec.name!r} needs {tp} GPU(s) with {_gib(per_rank + headroom(per_rank))} "
            f"free each (estimate {_gib(model_bytes_estimate)} / tp {tp} + headroom); "
            f"{len(fitting)} fit ({table})"
        )
    chosen = sorted(g.index for g in fitting[:tp])
    return [torch.device("cuda", ordinal[i]) for i in chosen]


def estimate_model_bytes(spec: ModelConfig, path: Path, *, on_gpu: bool = True) -> ModelEstimate:
    """Weights (as `spec.dtype` will hold them on a GPU, or on the CPU) plus the KV pool
    (`kv_cache_mb`, or by default `max_batch` × `context` tokens, plus two reserved blocks).

    The engine's own accounting (`engine.model.load.sizing.estimate_weight_bytes`): under "auto" a GPU
    holds bfloat16 weights, about 3.5x a Q4 file, so the file's size is no estimate. Reads the
    GGUF header and tensor table (memory-mapped; ~0.2 s for the built-in model). Raises
    ModelLoadError (UnsupportedModelError) if the file is not a usable GGUF model.
    """
    try:
        weights, kv = estimate_gguf_bytes(
            path,
            spec.dtype,
            "cuda" if on_gpu else "cpu",
            kv_cache_mb=spec.kv_cache_mb,
            max_batch=spec.max_batch,
            context=spec.context,
        )
    except ConfigError as exc:  # the KV budget holds no block (weights raise ModelLoadError)
        raise PlacementError(f"model {spec.name!r}: {exc}") from None
    return ModelEstimate(weights_bytes=weights, kv_cache_bytes=kv)
