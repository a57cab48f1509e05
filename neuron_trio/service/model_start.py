"""From a model entry to what its actor needs: the file, its size, its devices, its fingerprint.

`place_model` resolves the entry's source (a download for `hf:`), estimates the model's memory
from the file's header after its chat template has rendered a probe conversation in time (both
read the header only: a file refused here costs no weights), fingerprints it, and places it
on devices (`placement.place`). Errors name the file as the client did (its `source`), never
where that resolved to on the node.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import trio

from neuron_trio import failpoints as fp
from neuron_trio.config import ModelConfig, NeuronConfig
from neuron_trio.errors import ApiError, ConfigError, ModelFileError, ModelLoadError
from neuron_trio.executor.api import (
    ModelExecutor,
    build_executor,
    probe_gguf_chat_template,
    use_gguf_header_store,
    weight_cache,
)
from neuron_trio.service.documents.fingerprint import model_fingerprint
from neuron_trio.service.documents.node_document import ModelMemory
from neuron_trio.service.placement import (
    GpuSnapshotLike,
    ModelEstimate,
    estimate_model_bytes,
    place,
)
from neuron_trio.service.process.download_progress import DownloadProgress
from neuron_trio.service.sources import HubLimits, resolve_source

log = logging.getLogger(__name__)

ExecutorFactory = Callable[..., ModelExecutor]  # (spec, path, devices, *, failpoints)
Estimator = Callable[[ModelConfig, Path, bool], ModelEstimate]  # (spec, path, on_gpu)


class LiveGpuSnapshot(GpuSnapshotLike, Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class GpuSource(Protocol):
    """What the node needs of `gpu.actor.GpuActor`: a live NVML read."""

    async def live(self) -> LiveGpuSnapshot: ...


def default_factory(
    spec: ModelConfig,
    path: Path,
    devices: list[torch.device],
    *,
    failpoints: fp.Failpoints,
    config: NeuronConfig,
) -> ModelExecutor:
    """The real executor, with the node's packed-weight cache (`[node] weight_cache*`)."""
    node = config.node
    cache = weight_cache(
        config.weight_cache_path,
        node.weight_cache_max_mb << 20,
        min_file_bytes=node.weight_cache_min_mb << 20,
    )
    speculative = spec.speculative
    draft = speculative.source if speculative and speculative.method == "draft" else None
    return build_executor(
        spec,
        path,
        devices,
        failpoints=failpoints,
        weight_cache=cache if node.weight_cache else None,
        draft_path=None if draft is None else resolve_source(draft, config),
    )


def use_header_store(config: NeuronConfig) -> None:
    """Keep parsed GGUF headers between starts (`executor.api.use_gguf_header_store`) in the
    packed-weight cache's directory (`headers/`), where `[node] weight_cache` keeps those.
    The daemon calls it once, before its node reads any header."""
    directory = config.weight_cache_path / "headers" if config.node.weight_cache else None
    use_gguf_header_store(directory)


def default_estimator(spec: ModelConfig, path: Path, on_gpu: bool) -> ModelEstimate:
    """The header's size estimate, after the chat template has rendered a probe conversation
    in time (both read only the header: a file refused here costs no weights)."""
    estimate = estimate_model_bytes(spec, path, on_gpu=on_gpu)
    probe_gguf_chat_template(path, str(path))
    return estimate


@dataclass(frozen=True)
class PlacedModel:
    """A model entry ready for its actor: the file, its devices, and what it will take."""

    path: Path
    devices: list[torch.device]
    memory: ModelMemory
    fingerprint: str  # `system_fingerprint`


@contextmanager
def errors_naming_the_source(
    spec: ModelConfig, located: Callable[[], Path | None]
) -> Iterator[None]:
    """Errors of a model's start as the client may read them: a ModelLoadError whose text
    names the file as the client did (`spec.source`, not `located()`, where it resolved to);
    any other failure (a GPU read, a torch error) a ModelLoadError too. API and config errors
    pass unchanged."""
    try:
        yield
    except ModelLoadError as exc:
        path = located()
        if path is not None and str(path) in str(exc):
            raise type(exc)(str(exc).replace(str(path), spec.source)) from None
        raise
    except (ApiError, ConfigError):
        raise
    except Exception as exc:
        path = located()
        detail = str(exc) if path is None else str(exc).replace(str(path), spec.source)
        raise ModelLoadError(f"model {spec.name!r}: {type(exc).__name__}: {detail}") from exc


async def place_model(
    spec: ModelConfig,
    config: NeuronConfig,
    *,
    gpus: GpuSource | None,
    estimator: Estimator,
    host_memory: Callable[[], int | None],
    progress: Callable[[str], None],
    on_bytes: DownloadProgress | None,
    hub_limits: HubLimits | None,
) -> PlacedModel:
    """Resolve, check, estimate, fingerprint and place `spec` (see the module docstring).

    Raises ModelLoadError (SourceError, PlacementError, ModelFileError, ...), or ConfigError.
    Cancellation handling: the worker threads are abandoned (a download goes on until it
    next reports progress).
    """
    path: Path | None = None
    with errors_naming_the_source(spec, lambda: path):
        path = await trio.to_thread.run_sync(
            partial(
                resolve_source,
                spec.source,
                config,
                progress=progress,
                on_bytes=on_bytes,
                limits=hub_limits,
            ),
            abandon_on_cancel=True,
        )
        draft = spec.speculative.source if spec.speculative else None
        if draft is not None and hub_limits is not None:
            # A runtime load's draft is fetched here, under the same hub limits as its model;
            # the executor's own resolve of it then finds it in the cache.
            await trio.to_thread.run_sync(
                partial(resolve_source, draft, config, progress=progress, limits=hub_limits),
                abandon_on_cancel=True,
            )
        snapshot: GpuSnapshotLike | None = None
        if gpus is not None and spec.devices != "cpu":
            snapshot = await gpus.live()
        on_gpu = spec.devices != "cpu" and bool(snapshot and snapshot.gpus)
        try:
            estimate = await trio.to_thread.run_sync(
                estimator, spec, path, on_gpu, abandon_on_cancel=True
            )
        except ModelFileError as exc:
            # Name the file as the client did: where a source resolves to is not theirs.
            detail = str(exc).replace(str(path), spec.source)
            raise type(exc)(f"model {spec.name!r}: {detail}") from None
        fingerprint = await trio.to_thread.run_sync(
            model_fingerprint, path, spec.dtype, abandon_on_cancel=True
        )
        devices = place(
            spec,
            estimate.total_bytes,
            snapshot,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            host_available_bytes=await trio.to_thread.run_sync(host_memory),
        )
        log.info(
            "model %s: %s on %s (estimate %.2f GiB)",
            spec.name,
            path,
            ", ".join(map(str, devices)),
            estimate.total_bytes / (1 << 30),
        )
        memory = ModelMemory(
            weights_bytes=estimate.weights_bytes,
            kv_cache_bytes=estimate.kv_cache_bytes,
            total_bytes=estimate.total_bytes,
            devices=[str(d) for d in devices],
        )
        return PlacedModel(path=path, devices=devices, memory=memory, fingerprint=fingerprint)
