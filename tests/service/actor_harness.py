"""One model actor over a fake executor (tests/service/fakes.py) for the service tests: the real
Watchdog on trio-native threads (`FakeThreads`), metrics in a private registry, and MockClock
time moved by hand (`run_actor`); `Harness` starts consumers and reads metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing
from prometheus_client import CollectorRegistry

from neuron_trio.config import ModelConfig, WatchdogConfig
from neuron_trio.engine.types import SamplingParams
from neuron_trio.service.api import GenerationJob
from neuron_trio.service.metrics.model import NodeMetrics
from neuron_trio.service.metrics.watchdog import WatchdogMetrics
from neuron_trio.service.model_actor import ModelActor
from neuron_trio.service.wedge.watchdog import Watchdog

from .fakes import FakeDeadman, FakeExecutor, FakeThreads

STEP_TIMEOUT = 30.0
ABORT_DEADLINE = 60.0
PROBE_INTERVAL = 300.0


def spec(max_batch: int = 2, **kw: Any) -> ModelConfig:
    return ModelConfig(name="m", source="builtin:smollm2-135m", max_batch=max_batch, **kw)


def job(prompt: str = "hi", max_tokens: int = 3, **kw: Any) -> GenerationJob:
    return GenerationJob(
        model="m", params=SamplingParams(max_tokens=max_tokens), prompt=prompt, **kw
    )


class Harness:
    def __init__(
        self,
        nursery: trio.Nursery,
        actor: ModelActor,
        executor: FakeExecutor,
        threads: FakeThreads,
        clock: trio.testing.MockClock,
        registry: CollectorRegistry,
    ) -> None:
        self.nursery = nursery
        self.actor = actor
        self.executor = executor
        self.engine = executor.engine
        self.threads = threads
        self.clock = clock
        self.registry = registry

    def consume(self, j: GenerationJob, *, leave_after: int | None = None) -> dict[str, Any]:
        """Start a consumer task; its record fills in as events arrive."""
        record: dict[str, Any] = {"events": [], "error": None, "done": False}

        async def consumer() -> None:
            try:
                async with self.actor.generate(j) as events:
                    record["entered"] = True
                    async for event in events:
                        record["events"].append(event)
                        if leave_after is not None and len(record["events"]) >= leave_after:
                            break
            except Exception as exc:
                record["error"] = exc
            record["done"] = True

        self.nursery.start_soon(consumer)
        return record

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"model": "m", **labels})


def run_actor(
    test: Callable[[Harness], Awaitable[None]],
    *,
    max_batch: int = 2,
    max_queue: int = 2,
    burst_gap_s: float = 0.0,  # tests step at once unless they test the burst wait
    **spec_kw: Any,
) -> None:
    clock = trio.testing.MockClock()  # no autojump: time moves only when a test jumps it

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            threads = FakeThreads(nursery)
            executor = FakeExecutor(max_batch)
            registry = CollectorRegistry()
            watchdog = Watchdog(
                model_name="m",
                deadlines=WatchdogConfig(
                    step_timeout_s=STEP_TIMEOUT,
                    abort_deadline_s=ABORT_DEADLINE,
                    probe_interval_s=PROBE_INTERVAL,
                ),
                deadman=FakeDeadman(),  # type: ignore[arg-type]
                metrics=WatchdogMetrics.for_registry(registry),
                run_thread=threads,
            )
            actors: list[ModelActor] = []
            metrics = NodeMetrics(registry, lambda: [a.statistics() for a in actors])
            actor = ModelActor(
                spec(max_batch, **spec_kw),
                lambda: executor,
                max_queue=max_queue,
                watchdog=watchdog,
                metrics=metrics.for_model("m"),
                burst_gap_s=burst_gap_s,
            )
            actors.append(actor)
            await nursery.start(actor.run)
            await test(Harness(nursery, actor, executor, threads, clock, registry))
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()
