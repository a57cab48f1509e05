"""The `/v1/node` document's types: the engine's figures reach it whole, and `neuron status`
decodes the node's own document into them without losing a field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec

from neuron_trio.engine.types import EngineStatistics
from neuron_trio.service.documents.node_document import KVCacheInfo, ModelInfo, NodeInfo
from neuron_trio.service.wedge.records import InflightRequest, LastWedge, WatchdogStatistics
from tests.service.actor_harness import Harness, job, run_actor, settle
from tests.service.node_world import World, collect, make_config, run_world
from tests.service.node_world import job as node_job

# Every figure different, so that a figure lost (or two swapped) on the way shows.
ENGINE = EngineStatistics(
    slots_total=2,
    slots_in_use=1,
    prefilling=0,
    decoding=1,
    steps=7,
    prompt_tokens_total=11,
    generated_tokens_total=13,
    kv_blocks_total=101,
    kv_blocks_used=102,
    kv_blocks_cached=103,
    prefix_cache_queries_tokens=104,
    prefix_cache_hits_tokens=105,
    preemptions=106,
)
KV_FIGURES = ("kv_", "prefix_cache_", "preemptions")  # the engine's fields /v1/node shows


def test_every_kv_figure_of_the_engine_reaches_the_document() -> None:
    kv = msgspec.to_builtins(KVCacheInfo.from_statistics(ENGINE, prefix_cache=True))
    shown = [f.name for f in dataclasses.fields(EngineStatistics) if f.name.startswith(KV_FIGURES)]
    assert shown, "the engine has KV figures"
    for name in shown:  # a new engine figure must be mapped too
        assert getattr(ENGINE, name) in kv.values(), f"{name} is not in /v1/node's kv_cache"
    assert kv == {
        "block_tokens": 16,
        "blocks_total": 101,
        "blocks_used": 102,
        "blocks_cached": 103,
        "prefix_cache": True,
        "prefix_cache_queries_tokens": 104,
        "prefix_cache_hits_tokens": 105,
        "preemptions": 106,
    }


def test_the_actor_shows_the_engines_statistics_as_it_last_read_them() -> None:
    async def test(h: Harness) -> None:
        h.engine.statistics = lambda: ENGINE  # type: ignore[method-assign]
        record = h.consume(job(max_tokens=2))
        await settle()
        assert record["done"] and record["error"] is None
        stats = h.actor.statistics()
        assert stats.engine == ENGINE  # embedded, not copied field by field
        info = h.actor.info()
        assert info.slots_in_use == ENGINE.slots_in_use
        assert info.kv_cache == KVCacheInfo.from_statistics(ENGINE, prefix_cache=True)
        assert h.metric("neuron_model_kv_blocks_cached") == 103
        assert h.metric("neuron_model_kv_blocks") == 101
        assert h.metric("neuron_model_prefix_cache_queries_tokens_total") == 104
        assert h.metric("neuron_model_preemptions_total") == 106

    run_actor(test)


def test_status_decodes_the_nodes_document_without_losing_a_field(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        node.mark_serving()
        await collect(node, node_job())
        doc = await node.node_info()
        decoded = msgspec.json.decode(json.dumps(doc), type=NodeInfo)  # as `neuron status` reads
        assert msgspec.to_builtins(decoded) == doc

    run_world(tmp_path, test)
    # The parts a fresh node leaves empty: a wedge with its in-flight requests, a load error.
    wedge = LastWedge(
        what="step",
        at="2026-01-01T00:00:00.000Z",
        detected_after_s=30.0,
        outcome="recovered",
        inflight=[InflightRequest("m", 3, "running", 1.5, 10, 4)],
        abort="returned",
        abort_s=0.25,
        recovered_after_s=31.0,
    )
    model = ModelInfo(
        name="m",
        last_error="RuntimeError: x",
        watchdog=WatchdogStatistics(state="recovering", wedges=1, last_wedge=wedge),
    )
    doc = msgspec.to_builtins(NodeInfo(models=[model]))
    assert msgspec.to_builtins(msgspec.convert(doc, NodeInfo)) == doc
