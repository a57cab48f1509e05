"""A node in a world of fakes for the service tests: fake GPUs and notifier, a config with three
dummy model files, fake executors (tests/service/fakes.py) under the real Watchdog with
trio-native threads, and MockClock time (`run_world`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import trio.testing

from neuron_trio.config import ModelConfig, NeuronConfig, WatchdogConfig, config_from_mapping
from neuron_trio.engine.types import SamplingParams
from neuron_trio.failpoints import Failpoints, parse
from neuron_trio.service.api import GenerationJob
from neuron_trio.service.node import Node
from neuron_trio.service.placement import ModelEstimate
from neuron_trio.service.wedge.watchdog import Watchdog

from .fakes import FakeDeadman, FakeExecutor, FakeThreads

GIB = 1 << 30


@dataclass
class Reading:
    index: int
    memory_free_bytes: int
    memory_total_bytes: int = 80 * GIB
    error: str | None = None
    uuid: str = ""


@dataclass
class Snapshot:
    available: bool
    gpus: tuple[Reading, ...] = ()
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "gpus": [r.__dict__ for r in self.gpus]}


class FakeGpus:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.reads = 0

    async def live(self) -> Snapshot:
        self.reads += 1
        return self.snapshot


@dataclass
class FakeNotifier:
    lines: list[str] = field(default_factory=list)

    extended: list[tuple[float, str | None]] = field(default_factory=list)

    def status(self, text: str) -> bool:
        self.lines.append(text)
        return True

    def extend_timeout(self, seconds: float, status: str | None = None) -> bool:
        self.extended.append((seconds, status))
        if status is not None:
            self.lines.append(status)
        return True


@dataclass
class Identity:
    boot_id: str = "b00t"
    started_at: str = "2026-01-01T00:00:00Z"
    starts: int = 3
    previous_stop_clean: bool = False


def make_config(
    tmp_path: Path, models: list[dict[str, Any]] | None = None, **server: Any
) -> NeuronConfig:
    models_dir = tmp_path / "models"
    models_dir.mkdir(exist_ok=True)
    for name in ("a.gguf", "b.gguf", "c.gguf"):
        (models_dir / name).write_bytes(b"GGUF")
    data: dict[str, Any] = {
        "node": {"state_dir": str(tmp_path / "state"), "model_dirs": [str(models_dir)]},
        "server": {"max_queue": 2, **server},
        "default_models": models
        if models is not None
        else [{"name": "a", "source": "a.gguf", "max_batch": 2, "devices": "cpu"}],
    }
    return config_from_mapping(data, origin="test", environ={})


class World:
    def __init__(self, nursery: trio.Nursery, tmp_path: Path) -> None:
        self.nursery = nursery
        self.tmp_path = tmp_path
        self.threads = FakeThreads(nursery)
        self.executors: dict[str, FakeExecutor] = {}
        self.built: list[tuple[str, str, list[str]]] = []
        self.notifier = FakeNotifier()
        self.gpus = FakeGpus(Snapshot(available=False, reason="no NVML"))
        self.failpoints = Failpoints(parse("engine.step=hang"))
        self.fail_build: dict[str, Exception] = {}

    def factory(
        self, spec: ModelConfig, path: Path, devices: list[Any], *, failpoints: Any
    ) -> FakeExecutor:
        if spec.name in self.fail_build:
            raise self.fail_build[spec.name]
        assert failpoints is self.failpoints
        self.built.append((spec.name, Path(path).name, [str(d) for d in devices]))
        executor = self.executors[spec.name] = FakeExecutor(spec.max_batch)
        return executor

    def estimator(self, spec: ModelConfig, path: Path, on_gpu: bool) -> ModelEstimate:
        return ModelEstimate(weights_bytes=6 * GIB, kv_cache_bytes=2 * GIB)

    def watchdog(self, spec: ModelConfig) -> Watchdog:
        return Watchdog(
            model_name=spec.name,
            deadlines=WatchdogConfig(step_timeout_s=30, abort_deadline_s=60),
            deadman=FakeDeadman(),  # type: ignore[arg-type]
            run_thread=self.threads,
        )

    def node(self, config: NeuronConfig, **extra: Any) -> Node:
        return Node(
            config,
            gpus=self.gpus,
            identity=Identity(),
            notifier=self.notifier,
            failpoints=self.failpoints,
            executor_factory=self.factory,
            estimator=self.estimator,
            host_memory=lambda: 1 << 40,  # the fake estimates are not this machine's
            watchdog_factory=self.watchdog,
            hostname="node-1",
            burst_gap_s=0.0,  # time moves by hand here: step at once
            **extra,
        )


def run_world(tmp_path: Path, test: Callable[[World], Awaitable[None]]) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await test(World(nursery, tmp_path))
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock())


def job(model: str = "a", max_tokens: int = 2) -> GenerationJob:
    return GenerationJob(model=model, params=SamplingParams(max_tokens=max_tokens), prompt="hi")


async def collect(node: Node, j: GenerationJob) -> list[str]:
    async with node.generate(j) as events:
        return [e.text async for e in events]
