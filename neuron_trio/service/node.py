"""The node: the registry of model actors, health, identity, drain, and the metrics registry.

`Node` implements `service.api.NodeService` for the HTTP layer and gives the daemon its
life cycle:

    node = Node(config, gpus=gpu_actor, identity=identity, notifier=notifier)
    await nursery.start(node.run)   # loads default_models in order, then returns;
                                    # a default that cannot load: ModelLoadError (exit 69)
    node.mark_serving()             # /health 200 from now on (failpoints armed here)
    ...                             # first SIGTERM:
    node.begin_drain()              # new requests 503 "draining"; queued ones still run
    await node.wait_idle(timeout)   # True once no request is queued or running
    await node.unload_all()         # close every executor; `run` then returns
"""

from __future__ import annotations

import contextlib
import gc
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import msgspec
import torch
import trio
from prometheus_client import CollectorRegistry

from neuron_trio import failpoints as fp
from neuron_trio.config import ModelConfig, NeuronConfig, watchdog_for
from neuron_trio.errors import (
    ConfigError,
    ModelExistsError,
    ModelLoadError,
    ModelNotFoundError,
    RequestError,
    TooManyModelsError,
    UnavailableError,
)
from neuron_trio.service import heap, heap_trim
from neuron_trio.service.api import (
    GenerationJob,
    HealthSnapshot,
    ModelSummary,
    Tokenized,
    TokenizeJob,
)
from neuron_trio.service.documents.load_report import LoadReport, model_load, node_load
from neuron_trio.service.documents.node_report import (
    health_status,
    live_gpus,
    node_document,
    node_statistics,
)
from neuron_trio.service.documents.timefmt import utc_iso
from neuron_trio.service.kv_events.kv_events_publisher import KVEventsCollector, KVEventsPublisher
from neuron_trio.service.metrics.model import ModelActorStatistics, NodeMetrics
from neuron_trio.service.metrics.node import NodeCollector, NodeStatistics, TokenRates
from neuron_trio.service.metrics.watchdog import WatchdogMetrics
from neuron_trio.service.model_actor import BURST_GAP_S, ModelActor
from neuron_trio.service.model_start import (
    Estimator,
    ExecutorFactory,
    GpuSource,
    PlacedModel,
    default_estimator,
    default_factory,
    errors_naming_the_source,
    place_model,
)
from neuron_trio.service.placement import host_memory_available
from neuron_trio.service.process.download_progress import LOAD_SILENCE_S, DownloadProgress
from neuron_trio.service.requests.event_stream import EventStream
from neuron_trio.service.requests.tenant_limits import policies_from_config
from neuron_trio.service.sources import HubLimits
from neuron_trio.service.wedge.deadman import Deadman
from neuron_trio.service.wedge.forensics import LastForensics, find_last_forensics
from neuron_trio.service.wedge.watchdog import Watchdog

log = logging.getLogger(__name__)


class StatusSink(Protocol):
    """What the node needs of `service.process.notifier.Notifier`: STATUS= lines, and more time for
    the start while a default model downloads (EXTEND_TIMEOUT_USEC=)."""

    def status(self, text: str) -> Any: ...

    def extend_timeout(self, seconds: float, status: str | None = None) -> Any: ...


@dataclass(frozen=True)
class _Identity:
    boot_id: str
    started_at: str
    starts: int
    previous_stop_clean: bool = True


def _ephemeral_identity() -> _Identity:
    return _Identity(boot_id=uuid.uuid4().hex, started_at=utc_iso(time.time()), starts=1)


class Node:
    """The node's model registry and state; see the module docstring for the life cycle.

    `gpus` (a `GpuActor`), `identity` (an `Identity`), `notifier` (a `Notifier`) and
    `deadman` are optional for tests; the daemon passes the real ones. Without a deadman
    the node makes one (state_dir, with in-flight requests as context).
    """

    def __init__(
        self,
        config: NeuronConfig,
        *,
        gpus: GpuSource | None = None,
        identity: Any = None,
        notifier: StatusSink | None = None,
        deadman: Deadman | None = None,
        failpoints: fp.Failpoints | None = None,
        executor_factory: ExecutorFactory | None = None,
        estimator: Estimator | None = None,
        host_memory: Callable[[], int | None] | None = None,
        watchdog_factory: Callable[[ModelConfig], Watchdog | None] | None = None,
        hostname: str | None = None,
        burst_gap_s: float = BURST_GAP_S,
        settle_heap: bool = False,
    ) -> None:
        self.config = config
        self._settle_heap = settle_heap  # the daemon's node: heap.py after loads and unloads
        self._burst_gap_s = burst_gap_s  # ModelActor's wait for a burst of requests
        self.identity = identity if identity is not None else _ephemeral_identity()
        self.hostname = hostname or socket.gethostname()
        self.failpoints = fp.REGISTRY if failpoints is None else failpoints
        self.deadman = deadman or Deadman(config.state_path, context_fn=self.forensics_context)
        self._gpus = gpus
        self._notifier = notifier
        self._factory = executor_factory or partial(default_factory, config=config)
        self._estimator = estimator or default_estimator
        self._host_memory = host_memory or host_memory_available
        self._watchdog_factory = watchdog_factory or self._make_watchdog
        self._registry = CollectorRegistry()
        self._metrics = NodeMetrics(self._registry, self._model_statistics)
        self._actors: dict[str, ModelActor] = {}
        self._fingerprints: dict[str, str] = {}  # model name -> `system_fingerprint`
        self._reserved: set[str] = set()  # names being loaded
        self._nursery: trio.Nursery | None = None
        self._serving = False
        self._draining = False
        self._closed = trio.Event()
        self._last_forensics: LastForensics | None = None
        self._last_forensics_unix: float | None = None  # when it was written (its mtime)
        self._token_rates = TokenRates(self._metrics.generated_tokens)
        self._registry.register(NodeCollector(self))
        self.kv_events: KVEventsPublisher | None = None  # [kv_events] enabled: for routers
        if config.kv_events.enabled:
            self.kv_events = KVEventsPublisher(config.kv_events, hostname=self.hostname)
            self._registry.register(KVEventsCollector(self.kv_events))

    # ---- NodeService ----------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self._registry

    @property
    def models(self) -> dict[str, ModelActor]:
        return dict(self._actors)

    def health(self) -> HealthSnapshot:
        states = {name: actor.state for name, actor in self._actors.items()}
        status = health_status(
            states,
            deadman_firing=self.deadman.firing,
            draining=self._draining,
            serving=self._serving,
        )
        return HealthSnapshot(
            status=status,
            boot_id=str(self.identity.boot_id),
            started_at=str(self.identity.started_at),
            starts=int(self.identity.starts),
            detail={"models": states, "load": msgspec.to_builtins(self.load())},
        )

    def load(self, model: str | None = None) -> LoadReport:
        """How loaded `model` is, or the node when it is None or not loaded (cheap)."""
        actor = self._actors.get(model) if model is not None else None
        if actor is not None:
            return model_load(actor.statistics())
        return node_load(self._model_statistics())

    def list_models(self) -> list[ModelSummary]:
        return [
            ModelSummary(
                name=a.name,
                created=int(a.loaded_at or 0),
                context=a.context,
                fingerprint=self._fingerprints.get(a.name, ""),
            )
            for a in self._actors.values()
            if a.state in ("serving", "recovering")
        ]

    async def node_info(self) -> dict[str, Any]:
        """The `/v1/node` document (a live GPU read: may take up to the NVML timeout)."""
        gpus = await live_gpus(self._gpus)
        document = node_document(self, gpus, self._actors, self._token_rates, self._last_forensics)
        # As plain JSON values: what the HTTP layer encodes, and what tests and tools read.
        return msgspec.to_builtins(document)  # type: ignore[no-any-return]

    @asynccontextmanager
    async def generate(self, job: GenerationJob) -> AsyncIterator[EventStream]:
        """See NodeService.generate."""
        actor = self._actors.get(job.model)
        if actor is None or actor.state == "unloaded":
            raise ModelNotFoundError(job.model)
        if actor.state == "loading":
            raise UnavailableError(
                f"model {job.model!r} is loading", code="model_loading", retry_after_s=10
            )
        if self._draining:
            raise UnavailableError("the node is draining", code="draining", retry_after_s=5)
        async with actor.generate(job) as events:
            yield events

    async def tokenize(self, job: TokenizeJob) -> Tokenized:
        """See NodeService.tokenize."""
        actor = self._tokenizing_actor(job.model)
        return await actor.tokenize(replace(job, model=actor.name))

    async def detokenize(self, model: str | None, ids: tuple[int, ...]) -> str:
        """See NodeService.detokenize."""
        return await self._tokenizing_actor(model).detokenize(ids)

    def _tokenizing_actor(self, model: str | None) -> ModelActor:
        """`model`'s actor, or with None the only model's (llama.cpp's clients name none)."""
        if model is None:
            names = [name for name, a in self._actors.items() if a.state != "unloaded"]
            if len(names) != 1:
                raise RequestError(
                    f"model: required: this node serves {len(names)} models", param="model"
                )
            model = names[0]
        actor = self._actors.get(model)
        if actor is None or actor.state == "unloaded":
            raise ModelNotFoundError(model)
        if actor.state == "loading":
            raise UnavailableError(
                f"model {model!r} is loading", code="model_loading", retry_after_s=10
            )
        return actor

    async def load_model(self, spec: ModelConfig) -> dict[str, Any]:
        """Load `spec` at run time; its `/v1/node` entry once serving.

        Raises ModelExistsError (409) if the name is taken, UnavailableError (503) while
        draining or before `run`, ModelLoadError (SourceError, PlacementError, ...) if it
        cannot be loaded. Cancellation handling: cancelling the caller abandons the load.
        """
        if self._draining or self._nursery is None:
            raise UnavailableError("the node is not taking new models now", code="draining")
        loaded = len(self._actors) + len(self._reserved)
        if loaded >= self.config.node.max_models and spec.name not in self._actors:
            raise TooManyModelsError(self.config.node.max_models)
        actor = await self._start_model(spec, hub_limits=HubLimits.from_config(self.config))
        await self._settle()
        return msgspec.to_builtins(actor.info())  # type: ignore[no-any-return]

    async def unload_model(self, name: str) -> None:
        """Wait for `name`'s in-flight requests, then free it. Raises ModelNotFoundError."""
        actor = self._actors.get(name)
        if actor is None:
            raise ModelNotFoundError(name)
        await self._unload(actor)

    # ---- life cycle (daemon) --------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        """Load every default model (in order), report started, then host the model actors.

        Progress goes to the notifier's STATUS= and the log. A default model that cannot be
        loaded raises ModelLoadError (the daemon exits 69), or ConfigError when its entry
        cannot work as written, e.g. a tp that does not divide the heads (exit 78), before
        `started`. Returns after
        `unload_all()`; cancelling it stops every actor without draining.
        """
        self._last_forensics = await trio.to_thread.run_sync(
            find_last_forensics, self.config.state_path
        )
        if self._last_forensics is not None:
            log.warning("last forensics report: %s", self._last_forensics.path)
            with contextlib.suppress(OSError):
                self._last_forensics_unix = Path(self._last_forensics.path).stat().st_mtime
        failure: ModelLoadError | ConfigError | None = None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._token_rates.run, lambda: list(self._actors))
            if self._settle_heap:  # the daemon's: freed C heap back to the system
                nursery.start_soon(heap_trim.keep_trimmed)
            try:
                if self.kv_events is not None:
                    await nursery.start(self.kv_events.run)
                await self._load_defaults()
            except (ModelLoadError, ConfigError) as exc:
                failure = exc
                nursery.cancel_scope.cancel()
            else:
                if self._settle_heap:  # start-up's threads have their arenas: heap_trim.py
                    heap_trim.limit_arenas()
                task_status.started(self)
                await self._closed.wait()
                nursery.cancel_scope.cancel()
        self._nursery = None
        if failure is not None:
            raise failure

    async def _load_defaults(self) -> None:
        models = self.config.default_models
        for i, spec in enumerate(models, 1):
            self._status(
                f"loading {spec.name} ({i}/{len(models)}) from {spec.source}…",
                extend_s=LOAD_SILENCE_S,
            )
            started = time.monotonic()
            await self._start_model(spec)
            self._status(f"loaded {spec.name} in {time.monotonic() - started:.1f} s")
        await self._settle()

    async def _settle(self) -> None:
        """The loaded objects out of the garbage collector's walks (heap.py)."""
        if self._settle_heap:
            await trio.to_thread.run_sync(heap.settle)

    def mark_serving(self) -> None:
        """`/health` answers 200 from now on. Arms the failpoints (never before serving)."""
        self.failpoints.arm()
        self._serving = True

    def begin_drain(self) -> None:
        """New requests get 503 `draining`; queued and running ones go on."""
        self._draining = True

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` seconds) until no request is queued or running; True if so."""
        with trio.move_on_after(float("inf") if timeout is None else timeout):
            while True:
                busy = [a for a in self._actors.values() if not a.idle]
                if not busy:
                    return True
                await busy[0].wait_idle()
        return False

    async def unload_all(self) -> None:
        """Unload every model now (free the GPUs before exit); `run` then returns.

        Meant for after `wait_idle`: requests still queued or running get 503 at once rather
        than being waited for. Each executor closes once its current step has come back.
        """
        self._draining = True
        try:
            async with trio.open_nursery() as nursery:
                for actor in list(self._actors.values()):
                    nursery.start_soon(partial(self._unload, actor, force=True))
        finally:
            self._closed.set()

    # ---- inside ---------------------------------------------------------------------------

    def _status(self, text: str, *, extend_s: float | None = None) -> None:
        """Log `text` and show it as STATUS=; with `extend_s`, also ask systemd for that much
        more time to start (a default model's load is progress, not silence)."""
        log.info("%s", text)
        if self._notifier is not None:
            with contextlib.suppress(Exception):
                if extend_s is None:
                    self._notifier.status(text)
                else:
                    self._notifier.extend_timeout(extend_s, text)

    def _download_progress(self, spec: ModelConfig) -> DownloadProgress | None:
        """Bytes and percent to systemd while a default model downloads, each report with more
        time for the start. Not for run-time loads: the node is started by then."""
        if self._notifier is None or self._serving:
            return None
        return DownloadProgress(self._notifier, f"{spec.name} ({spec.source})")

    def _make_watchdog(self, spec: ModelConfig) -> Watchdog:
        metrics = WatchdogMetrics.for_registry(self._registry)
        metrics.zero(spec.name)
        return Watchdog(
            model_name=spec.name,
            deadlines=watchdog_for(self.config, spec),
            deadman=self.deadman,
            metrics=metrics,
        )

    def node_statistics(self) -> NodeStatistics:
        """For `/metrics` (service.metrics.node): identity, health, the last deadman exit."""
        return node_statistics(
            identity=self.identity,
            hostname=self.hostname,
            status=self.health().status,
            last_forensics_unix=self._last_forensics_unix,
        )

    def _model_statistics(self) -> list[ModelActorStatistics]:
        return [actor.statistics() for actor in list(self._actors.values())]

    def forensics_context(self) -> dict[str, Any]:
        """For the deadman's report (called on its thread): in-flight requests, model states."""
        actors = list(self._actors.values())
        return {
            "inflight": [r for actor in actors for r in actor.inflight()],
            "models": {actor.name: actor.state for actor in actors},
            "draining": self._draining,
        }

    async def _start_model(
        self, spec: ModelConfig, *, hub_limits: HubLimits | None = None
    ) -> ModelActor:
        if spec.name in self._actors or spec.name in self._reserved:
            raise ModelExistsError(spec.name)
        assert self._nursery is not None
        self._reserved.add(spec.name)
        placed: PlacedModel | None = None
        try:
            with errors_naming_the_source(spec, lambda: placed.path if placed else None):
                placed = await place_model(
                    spec,
                    self.config,
                    gpus=self._gpus,
                    estimator=self._estimator,
                    host_memory=self._host_memory,
                    progress=self._status,
                    on_bytes=self._download_progress(spec),
                    hub_limits=hub_limits,
                )
                actor = ModelActor(
                    spec,
                    partial(
                        self._factory,
                        spec,
                        placed.path,
                        placed.devices,
                        failpoints=self.failpoints,
                    ),
                    max_queue=self.config.server.max_queue,
                    watchdog=self._watchdog_factory(spec),
                    metrics=self._metrics.for_model(spec.name),
                    source_path=str(placed.path),
                    burst_gap_s=self._burst_gap_s,
                    load_timeout_s=self.config.node.load_timeout_s,
                    tenants=policies_from_config(self.config.tenants),
                    memory=placed.memory,
                )
                self._actors[spec.name] = actor
                self._fingerprints[spec.name] = placed.fingerprint
                try:
                    await self._nursery.start(actor.run)
                except BaseException:
                    self._actors.pop(spec.name, None)
                    raise
                if self.kv_events is not None and actor.executor is not None:
                    self.kv_events.attach(spec.name, actor.executor.engine)
        finally:
            self._reserved.discard(spec.name)
        return actor

    async def _unload(self, actor: ModelActor, *, force: bool = False) -> None:
        on_cuda = any("cuda" in device for device in actor.info().devices)
        await actor.unload(force=force)
        if self.kv_events is not None:
            self.kv_events.detach(actor.name)
        if self._actors.get(actor.name) is actor:
            del self._actors[actor.name]
            self._fingerprints.pop(actor.name, None)
        await trio.to_thread.run_sync(_free_memory, on_cuda, self._settle_heap)


def _free_memory(on_cuda: bool, settled: bool) -> None:
    if settled:
        heap.release()  # collects, the unloaded model's cycles too
    else:
        gc.collect()
    if on_cuda and torch.cuda.is_available():
        torch.cuda.empty_cache()
