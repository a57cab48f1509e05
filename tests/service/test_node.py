"""The node: default models, health, run-time load/unload, drain, /v1/node, metrics.

A world of fakes (tests/service/node_world.py) with the real Watchdog on trio-native threads;
the slow test at the end serves the built-in model for real.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import generate_latest

from neuron_trio.config import ModelConfig, config_from_mapping
from neuron_trio.engine.types import SamplingParams
from neuron_trio.errors import (
    ModelExistsError,
    ModelLoadError,
    ModelNotFoundError,
    PlacementError,
    RequestError,
    SourceError,
    UnavailableError,
)
from neuron_trio.failpoints import Failpoints
from neuron_trio.service import heap, heap_trim
from neuron_trio.service import node as node_module
from neuron_trio.service.api import ChatMessage, GenerationJob
from neuron_trio.service.node import Node
from neuron_trio.service.wedge.forensics import find_last_forensics

from .fakes import FakeExecutor
from .node_world import (
    GIB,
    Reading,
    Snapshot,
    World,
    collect,
    job,
    make_config,
    run_world,
)


def test_defaults_load_in_order_with_progress_then_health_goes_ok(tmp_path: Path) -> None:
    config = make_config(
        tmp_path,
        [
            {"name": "a", "source": "a.gguf", "devices": "cpu"},
            {"name": "b", "source": str(tmp_path / "models" / "b.gguf"), "tp": 2},
        ],
    )

    async def test(w: World) -> None:
        node = w.node(config)
        assert node.health().status == "starting"
        started = await w.nursery.start(node.run)
        assert started is node
        assert [b[:2] for b in w.built] == [("a", "a.gguf"), ("b", "b.gguf")]
        assert w.built[1][2] == ["cpu", "cpu"]  # auto without GPUs: CPU ranks
        assert w.notifier.lines[0].startswith("loading a (1/2) from a.gguf")
        assert w.notifier.lines[2].startswith("loading b (2/2)")
        assert w.notifier.lines[1].startswith("loaded a in ") and w.notifier.lines[1].endswith(" s")
        health = node.health()
        assert health.status == "starting" and health.starts == 3 and health.boot_id == "b00t"
        assert not w.failpoints.take("engine.step")  # not armed before serving
        node.mark_serving()
        assert node.health().status == "ok"
        assert "engine.step" in w.failpoints.configured  # armed now
        assert [m.name for m in node.list_models()] == ["a", "b"]
        # system_fingerprint: computed at load; the same bytes and dtype give the same one
        prints = [m.fingerprint for m in node.list_models()]
        assert prints[0].startswith("fp_") and prints[0] == prints[1]
        assert await collect(node, job()) == ["x", "x"]

    run_world(tmp_path, test)


@pytest.mark.parametrize("settle_heap", [True, False])
def test_the_daemons_node_settles_the_heap_after_loads_and_thaws_it_to_unload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settle_heap: bool
) -> None:
    """heap.py: the daemon's node (settle_heap) freezes the loaded objects once the defaults
    are in (and caps malloc's arenas, heap_trim.py) and after each load, and thaws them to free an unloaded model; any other node
    (tests, tools) leaves the collector alone but for a collection after an unload."""
    calls: list[str] = []
    monkeypatch.setattr(heap, "settle", lambda: calls.append("settle"))
    monkeypatch.setattr(heap, "release", lambda: calls.append("release"))
    monkeypatch.setattr(heap_trim, "limit_arenas", lambda: calls.append("cap arenas") or True)
    monkeypatch.setattr(node_module.gc, "collect", lambda: calls.append("collect") or 0)
    config = make_config(tmp_path, [{"name": "a", "source": "a.gguf", "devices": "cpu"}])

    async def test(w: World) -> None:
        node = w.node(config, settle_heap=settle_heap)
        await w.nursery.start(node.run)
        # ready: the malloc arenas capped once start-up's threads have theirs (c_heap.py)
        settled = ["settle", "cap arenas"] if settle_heap else []
        assert calls == settled
        await node.load_model(ModelConfig(name="b", source="b.gguf", devices="cpu"))
        assert calls == ([*settled, "settle"] if settle_heap else [])
        await node.unload_model("b")
        assert calls == ([*settled, "settle", "release"] if settle_heap else ["collect"])

    run_world(tmp_path, test)


def test_a_default_model_that_cannot_load_raises_model_load_error(tmp_path: Path) -> None:
    config = make_config(
        tmp_path,
        [
            {"name": "a", "source": "a.gguf", "devices": "cpu"},
            {"name": "b", "source": "b.gguf", "devices": "cpu"},
        ],
    )

    async def test(w: World) -> None:
        w.fail_build["b"] = RuntimeError("out of memory")
        node = w.node(config)
        with pytest.raises(ModelLoadError, match=r"'b'.*out of memory"):  # not a group
            await w.nursery.start(node.run)
        assert w.executors["a"].closed is False  # cancelled, not unloaded: the process exits

    run_world(tmp_path, test)


def test_a_source_outside_model_dirs_fails_the_start(tmp_path: Path) -> None:
    config = make_config(tmp_path, [{"name": "a", "source": "/etc/passwd", "devices": "cpu"}])

    async def test(w: World) -> None:
        with pytest.raises(SourceError, match="outside the model directories"):
            await w.nursery.start(w.node(config).run)

    run_world(tmp_path, test)


def test_run_time_load_conflicts_and_unload(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        node.mark_serving()
        info = await node.load_model(ModelConfig(name="b", source="b.gguf", devices="cpu"))
        assert info["name"] == "b" and info["state"] == "serving"
        with pytest.raises(ModelExistsError) as conflict:
            await node.load_model(ModelConfig(name="b", source="a.gguf"))
        assert conflict.value.status == 409
        w.fail_build["c"] = ValueError("tp = 2 does not split 9 heads")
        with pytest.raises(ModelLoadError, match="does not split"):
            await node.load_model(ModelConfig(name="c", source="a.gguf", devices="cpu"))
        assert "c" not in node.models
        await node.unload_model("b")
        assert w.executors["b"].closed and "b" not in node.models
        with pytest.raises(ModelNotFoundError):
            await node.unload_model("b")
        with pytest.raises(ModelNotFoundError):
            async with node.generate(job("b")):
                pass

    run_world(tmp_path, test)


def test_a_model_being_loaded_answers_503_and_is_not_listed(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        node.mark_serving()
        entered = trio.Event()
        proceed = threading.Event()
        factory = w.factory
        token = trio.lowlevel.current_trio_token()  # the load's thread is not trio's own

        def slow_factory(spec: ModelConfig, *args: Any, **kw: Any) -> FakeExecutor:
            trio.from_thread.run_sync(entered.set, trio_token=token)
            proceed.wait()
            return factory(spec, *args, **kw)

        w.factory = slow_factory  # type: ignore[method-assign]
        node._factory = slow_factory
        loaded: list[dict[str, Any]] = []
        done = trio.Event()

        async def load() -> None:
            loaded.append(await node.load_model(ModelConfig(name="slow", source="b.gguf")))
            done.set()

        w.nursery.start_soon(load)
        await entered.wait()
        assert node.models["slow"].state == "loading"
        assert node.health().status == "ok"
        assert [m.name for m in node.list_models()] == ["a"]
        with pytest.raises(UnavailableError, match="loading") as info:
            async with node.generate(job("slow")):
                pass
        assert info.value.code == "model_loading"
        with pytest.raises(ModelExistsError):
            await node.load_model(ModelConfig(name="slow", source="a.gguf"))
        proceed.set()
        await done.wait()
        assert loaded[0]["state"] == "serving"
        assert await collect(node, job("slow")) == ["x", "x"]

    run_world(tmp_path, test)


def test_placement_uses_a_live_gpu_read(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        w.gpus.snapshot = Snapshot(True, (Reading(0, 4 * GIB), Reading(1, 40 * GIB)))
        node = w.node(make_config(tmp_path, []))
        await w.nursery.start(node.run)
        await node.load_model(ModelConfig(name="g", source="a.gguf"))
        assert w.built[-1] == ("g", "a.gguf", ["cuda:1"])
        assert w.gpus.reads == 1
        with pytest.raises(PlacementError, match="needs 2 GPU"):
            await node.load_model(ModelConfig(name="h", source="a.gguf", tp=2))

    run_world(tmp_path, test)


def test_unload_waits_for_in_flight_requests(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        node.mark_serving()
        w.threads.hold()
        results: list[list[str]] = []

        async def request() -> None:
            results.append(await collect(node, job(max_tokens=3)))

        w.nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        unloaded = trio.Event()

        async def unload() -> None:
            await node.unload_model("a")
            unloaded.set()

        w.nursery.start_soon(unload)
        await trio.testing.wait_all_tasks_blocked()
        assert not unloaded.is_set() and node.models["a"].state == "serving"
        w.threads.release()
        await unloaded.wait()
        assert results == [["x", "x", "x"]] and w.executors["a"].closed

    run_world(tmp_path, test)


def test_drain_refuses_new_requests_and_waits_for_idle(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        run_done = trio.Event()

        async def run_node(task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
            await node.run(task_status=task_status)
            run_done.set()

        await w.nursery.start(run_node)
        node.mark_serving()
        w.threads.hold()
        results: list[list[str]] = []

        async def request() -> None:
            results.append(await collect(node, job(max_tokens=2)))

        w.nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        node.begin_drain()
        assert node.draining and node.health().status == "draining"
        with pytest.raises(UnavailableError, match="draining"):
            async with node.generate(job()):
                pass
        assert await node.wait_idle(0) is False
        w.threads.release()
        assert await node.wait_idle(5) is True
        assert results == [["x", "x"]]
        await node.unload_all()
        await run_done.wait()
        assert w.executors["a"].closed and node.models == {}

    run_world(tmp_path, test)


def test_unload_all_fails_what_is_still_in_flight(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        w.threads.hold()
        errors: list[Exception] = []

        async def request() -> None:
            try:
                await collect(node, job(max_tokens=5))
            except UnavailableError as exc:
                errors.append(exc)

        w.nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        node.begin_drain()
        async with trio.open_nursery() as inner:
            inner.start_soon(node.unload_all)
            await trio.testing.wait_all_tasks_blocked()
            assert len(errors) == 1  # failed at once, not waited for
            w.threads.release()  # the step in progress comes back; then the executor closes
        assert w.executors["a"].closed

    run_world(tmp_path, test)


def test_health_reports_a_recovering_model(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        node.mark_serving()
        w.threads.hold()
        w.nursery.start_soon(lambda: _swallow(collect(node, job())))
        await trio.testing.wait_all_tasks_blocked()
        trio.lowlevel.current_clock().jump(30)  # type: ignore[attr-defined]
        await trio.testing.wait_all_tasks_blocked()
        health = node.health()
        assert health.status == "recovering" and health.detail["models"] == {"a": "recovering"}
        w.threads.release()
        await trio.testing.wait_all_tasks_blocked()
        assert node.health().status == "ok"

    run_world(tmp_path, test)


async def _swallow(awaitable: Awaitable[Any]) -> None:
    try:
        await awaitable
    except UnavailableError:
        pass


def test_node_info_document(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        forensics = Path(w.tmp_path / "state" / "forensics")
        forensics.mkdir(parents=True)
        (forensics / "20260101T000000Z.json").write_text(json.dumps({"reason": "old"}))
        newest = forensics / "20260102T000000Z.json"
        newest.write_text(json.dumps({"reason": "abort-deadline"}))
        os.utime(forensics / "20260101T000000Z.json", (1, 1))
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        node.mark_serving()
        info = await node.node_info()
        json.dumps(info)  # serialisable as it is
        assert info["hostname"] == "node-1" and info["boot_id"] == "b00t" and info["starts"] == 3
        assert info["gpus"] == {"available": False, "gpus": []}
        (model,) = info["models"]
        assert model["name"] == "a" and model["state"] == "serving" and model["tp"] == 1
        assert model["ranks"] == [{"device": "cpu", "heads": 9, "kv_heads": 3}]
        assert model["slots_in_use"] == 0 and model["queued"] == 0 and model["weights"] == "float32"
        assert model["memory"]["total_bytes"] == 8 * GIB and model["memory"]["devices"] == ["cpu"]
        assert info["watchdog"]["models"]["a"]["state"] == "idle"
        assert info["watchdog"]["step_timeout_s"] == 30
        assert info["last_forensics"] == {
            "path": str(newest),
            "report": {"reason": "abort-deadline"},
        }
        assert info["failpoints"]["configured"] == {"engine.step": "hang"}
        # the contract's keys (docs/DESIGN.md, /v1/node), exactly
        assert list(info) == [
            "hostname", "boot_id", "started_at", "starts", "previous_stop_clean", "status",
            "draining", "config", "gpus", "models", "generated_tokens_per_s_1m", "watchdog",
            "last_forensics", "failpoints",
        ]  # fmt: skip
        assert list(model) == [
            "name", "state", "source", "path", "dtype", "weights", "tp", "max_batch",
            "context", "slots_in_use", "slots_total", "kv_cache", "speculative", "running", "queued",
            "max_queue", "ranks", "devices", "memory", "loaded_at", "steps", "step_failures",
            "last_error", "watchdog",
        ]  # fmt: skip
        assert list(model["kv_cache"]) == [
            "block_tokens", "blocks_total", "blocks_used", "blocks_cached", "prefix_cache",
            "prefix_cache_queries_tokens", "prefix_cache_hits_tokens", "preemptions",
        ]  # fmt: skip
        assert model["kv_cache"]["block_tokens"] == 16 and model["kv_cache"]["prefix_cache"]
        assert model["memory"] == {
            "weights_bytes": 6 * GIB,
            "kv_cache_bytes": 2 * GIB,
            "total_bytes": 8 * GIB,
            "devices": ["cpu"],
        }
        assert list(info["watchdog"]) == [
            "step_timeout_s", "abort_deadline_s", "probe_interval_s", "deadman_firing",
            "deadman_reason", "models",
        ]  # fmt: skip
        assert model["watchdog"] == info["watchdog"]["models"]["a"]
        assert list(info["failpoints"]) == ["configured", "fired"]

    run_world(tmp_path, test)


def test_find_last_forensics_without_reports(tmp_path: Path) -> None:
    assert find_last_forensics(tmp_path) is None
    (tmp_path / "forensics").mkdir()
    (tmp_path / "forensics" / "x.json").write_text("{not json")
    found = find_last_forensics(tmp_path)
    assert found is not None and "unreadable" in found.report


def test_metrics_registry_has_model_metrics(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        node.mark_serving()
        await collect(node, job())
        text = generate_latest(node.metrics_registry).decode()
        assert 'neuron_model_requests_total{model="a",outcome="length"} 1.0' in text
        assert 'neuron_model_kv_slots{model="a"} 2.0' in text
        assert 'neuron_model_kv_blocks{model="a"} 8.0' in text  # 2 x 64 tokens
        assert 'neuron_model_kv_blocks_used{model="a"} 0.0' in text  # the request ended
        steps = node.models["a"].statistics().steps
        assert steps > 0
        hits = f'neuron_model_prefix_cache_hits_tokens_total{{model="a"}} {steps * 5.0}'
        assert hits in text
        assert 'neuron_model_state{model="a",state="serving"} 1.0' in text

    run_world(tmp_path, test)


@pytest.mark.slow
def test_serves_the_builtin_model(tmp_path: Path) -> None:
    """The real thing on the CPU: default config, built-in model, a greedy chat answer."""
    config = config_from_mapping(
        {
            "node": {"state_dir": str(tmp_path)},
            "default_models": [
                {
                    "name": "smollm2-135m",
                    "source": "builtin:smollm2-135m",
                    "max_batch": 2,
                    "context": 512,
                    "dtype": "float32",
                }
            ],
        },
        origin="test",
        environ={},
    )

    async def main() -> None:
        node = Node(config, failpoints=Failpoints())
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            node.mark_serving()
            j = GenerationJob(
                model="smollm2-135m",
                params=SamplingParams(max_tokens=12, temperature=0.0),
                messages=(ChatMessage("user", "What is the capital of France?"),),
            )
            async with node.generate(j) as events:
                got = [e async for e in events]
            text = "".join(e.text for e in got)
            assert "Paris" in text, text
            assert got[-1].finish_reason in ("stop", "length")
            info = await node.node_info()
            assert info["models"][0]["ranks"][0]["heads"] == 9
            assert info["models"][0]["slots_in_use"] == 0
            text = generate_latest(node.metrics_registry).decode()
            assert 'neuron_watchdog_recovering{model="smollm2-135m"} 0.0' in text
            await node.unload_all()

    trio.run(main)


def test_runtime_loads_stop_at_max_models(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    config = msgspec.structs.replace(
        config, node=msgspec.structs.replace(config.node, max_models=2)
    )

    async def test(w: World) -> None:
        node = w.node(config)
        await w.nursery.start(node.run)
        node.mark_serving()
        await node.load_model(ModelConfig(name="b", source="b.gguf", devices="cpu"))
        with pytest.raises(RequestError, match=r"node\.max_models") as refused:
            await node.load_model(ModelConfig(name="c", source="c.gguf", devices="cpu"))
        assert refused.value.status == 409 and "c" not in node.models
        assert [b[0] for b in w.built] == ["a", "b"]  # nothing built for c
        await node.unload_model("b")
        await node.load_model(ModelConfig(name="c", source="c.gguf", devices="cpu"))
        assert "c" in node.models

    run_world(tmp_path, test)
