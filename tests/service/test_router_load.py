"""What a router reads of a node: the load figures (`/health`, the model-server-protocol gauges
of `/metrics` as the README's endpoint-picker flags select them) and the KV events' wiring."""

from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec
import trio
import zmq
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from neuron_trio.config import config_from_mapping
from neuron_trio.engine.types import EngineStatistics
from neuron_trio.service.documents.load_report import IDLE, LoadReport, model_load, node_load
from neuron_trio.service.kv_events.kv_events_publisher import KVEventsPublisher
from neuron_trio.service.metrics.model import ModelActorStatistics
from neuron_trio.service.node import Node

from .node_world import World, job, make_config, run_world

README = Path(__file__).resolve().parents[2] / "README.md"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _stats(
    *, name: str = "a", queued: int = 0, running: int = 0, slots_total: int = 4, **engine: int
) -> ModelActorStatistics:
    """A model's statistics; `engine`: the engine's figures (slots_in_use, kv_blocks_...)."""
    figures = dict(
        slots_total=slots_total, slots_in_use=0, prefilling=0, decoding=0, steps=0,
        prompt_tokens_total=0, generated_tokens_total=0, kv_blocks_total=100,
    )  # fmt: skip
    return ModelActorStatistics(
        name=name, state="serving", queued=queued, running=running, slots_total=slots_total,
        steps=0, failures=0, engine=EngineStatistics(**(figures | engine)),
    )  # fmt: skip


def test_model_load_figures() -> None:
    assert model_load(_stats()) == IDLE
    busy = model_load(_stats(running=2, slots_in_use=3, kv_blocks_used=25, queued=0))
    assert busy == LoadReport(
        num_requests_waiting=0, num_requests_running=2, kv_cache_usage_perc=0.25,
        application_utilization=0.75,
    )  # fmt: skip
    # the KV cache full before the slots: usage leads; a queue adds its share above 1
    full = model_load(_stats(running=1, slots_in_use=1, kv_blocks_used=100, queued=6))
    assert (full.kv_cache_usage_perc, full.application_utilization) == (1.0, 2.5)
    # a model not loaded yet (no pool) is idle, not a division by zero
    assert model_load(_stats(kv_blocks_total=0, slots_total=0)) == IDLE


def test_node_load_sums_requests_and_takes_the_fullest_model() -> None:
    assert node_load([]) == IDLE
    load = node_load(
        [
            _stats(queued=1, running=4, slots_in_use=4, kv_blocks_used=10),
            _stats(name="b", running=1, slots_in_use=1, kv_blocks_used=90),
        ]
    )
    assert load == LoadReport(
        num_requests_waiting=1, num_requests_running=5, kv_cache_usage_perc=0.9,
        application_utilization=1.25,
    )  # fmt: skip


async def _fill(w: World, tmp_path: Path) -> tuple[Node, list[trio.Event]]:
    """Model "a" (2 slots, 8 KV blocks) with two requests running (held in their first
    step: 4 prompt tokens, one block) and one queued."""
    node = w.node(make_config(tmp_path))
    await w.nursery.start(node.run)
    node.mark_serving()
    w.threads.hold()
    done = [trio.Event() for _ in range(3)]

    async def one(event: trio.Event) -> None:
        async with node.generate(job(max_tokens=2)) as events:
            async for _ in events:
                pass
        event.set()

    for event in done:
        w.nursery.start_soon(one, event)
    await trio.testing.wait_all_tasks_blocked()
    return node, done


def test_health_carries_the_load_while_requests_run(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node, done = await _fill(w, tmp_path)
        load = node.health().detail["load"]
        # 2 of 2 slots, 1 of 8 blocks (the fake engine pools the 4 prompt tokens), one queued
        assert load == {
            "num_requests_waiting": 1,
            "num_requests_running": 2,
            "kv_cache_usage_perc": 0.125,
            "application_utilization": 1.5,
        }
        assert node.load("a") == msgspec.convert(load, LoadReport)
        assert node.load("not-loaded") == node.load()
        msgspec.json.encode(node.health().detail)  # JSON-able
        w.threads.release()
        for event in done:
            await event.wait()
        assert node.health().detail["load"] == msgspec.to_builtins(IDLE)

    run_world(tmp_path, test)


def _picker_flags() -> dict[str, str]:
    """The endpoint-picker flags the README gives, `--name=spec`."""
    text = README.read_text()
    return dict(re.findall(r"^--([a-z-]+-metric)=(\S*)$", text, flags=re.MULTILINE))


def _spec(spec: str) -> tuple[str, dict[str, str]]:
    """The picker's `stringToMetricSpec`: NAME or NAME{label=value,...}, values unquoted."""
    name, _, rest = spec.partition("{")
    labels = {}
    if rest:
        assert rest.endswith("}"), spec
        for pair in rest[:-1].split(","):
            key, value = pair.split("=")
            labels[key.strip()] = value.strip()
    return name.strip(), labels


def test_the_readmes_picker_flags_select_the_gauges_of_a_real_scrape(tmp_path: Path) -> None:
    flags = _picker_flags()
    assert set(flags) == {
        "total-queued-requests-metric", "total-running-requests-metric",
        "kv-cache-usage-percentage-metric", "cache-info-metric", "lora-info-metric",
    }  # fmt: skip
    assert flags["lora-info-metric"] == ""  # no adapters: the metric is off

    async def test(w: World) -> None:
        node, _ = await _fill(w, tmp_path)
        text = generate_latest(node.metrics_registry).decode()
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

        def pick(flag: str) -> tuple[float, dict[str, str]]:
            name, labels = _spec(flags[flag].replace("smollm2-135m", "a"))
            found = [
                s for s in samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
            ]  # fmt: skip
            assert len(found) == 1, (flag, found)
            return found[0].value, found[0].labels

        assert pick("total-queued-requests-metric")[0] == 1
        assert pick("total-running-requests-metric")[0] == 2
        assert pick("kv-cache-usage-percentage-metric")[0] == 0.125
        value, labels = pick("cache-info-metric")
        # the picker reads these two labels with strconv.Atoi
        assert (int(labels["block_size"]), int(labels["num_gpu_blocks"])) == (16, 8)
        assert value == 1
        w.threads.release()

    run_world(tmp_path, test)


async def _replayed(publisher: KVEventsPublisher, at_least: int) -> list[object]:
    """The events of every batch the replay socket holds, once it holds `at_least` (asked
    again after each flush; no subscriber races the first batches this way)."""
    assert publisher.replay_endpoint is not None
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(publisher.replay_endpoint)
        for _ in range(200):  # real time (the world's clock is not the publisher's): 10 s
            batches: list[object] = []
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                assert await trio.to_thread.run_sync(dealer.poll, 10_000)
                frames = dealer.recv_multipart()
                if frames[1] == END_SEQ:
                    break
                batches.append(msgspec.msgpack.decode(frames[2])[1])
            if len(batches) >= at_least:
                return batches
            await trio.to_thread.run_sync(time.sleep, 0.05)  # the next flush
    finally:
        dealer.close()
    raise AssertionError(f"fewer than {at_least} batches after 10 s: {batches}")


def test_node_publishes_a_models_events_from_load_to_unload(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    data = {
        "node": {"state_dir": config.node.state_dir, "model_dirs": config.node.model_dirs},
        "default_models": [{"name": "a", "source": "a.gguf", "max_batch": 2, "devices": "cpu"}],
        "kv_events": {
            "enabled": True,
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
        },
    }
    config = config_from_mapping(data, origin="test", environ={})

    async def test(w: World) -> None:
        node = w.node(config)
        await w.nursery.start(node.run)
        publisher = node.kv_events
        assert publisher is not None and publisher.topic_for("a") == b"kv@node-1@a"
        assert w.executors["a"].engine.kv_log is not None  # attached once the model serves
        # at load: "all cleared" (what was known of "a" here is stale); at unload: again
        assert await _replayed(publisher, 1) == [[["AllBlocksCleared"]]]
        await node.unload_model("a")
        assert await _replayed(publisher, 2) == [[["AllBlocksCleared"]], [["AllBlocksCleared"]]]

    run_world(tmp_path, test)


def test_no_publisher_unless_enabled(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        assert node.kv_events is None
        await w.nursery.start(node.run)
        assert w.executors["a"].engine.kv_log is None

    run_world(tmp_path, test)
