"""Issue 25 (#6): a job's cache salt reaches the engine (the block pool keys by it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.service.node_world import World, collect, job, make_config, run_world


def test_the_jobs_cache_salt_is_given_to_the_engine(tmp_path: Path) -> None:
    config = make_config(tmp_path, [{"name": "a", "source": "a.gguf", "devices": "cpu"}])

    async def test(w: World) -> None:
        node = w.node(config)
        await w.nursery.start(node.run)
        node.mark_serving()
        await collect(node, replace(job(), cache_salt=b"tenant"))
        await collect(node, job())
        assert w.executors["a"].engine.salts == [b"tenant", None]

    run_world(tmp_path, test)
