"""Model families through the daemon (slow): Gemma 3 loaded at run time through POST /v1/models
from a local path under model_dirs; an unsupported file is a 422 at run time and exit 69 at
start, naming the architecture."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from neuron_trio.config import NeuronConfig, NodeConfig, ServerConfig
from neuron_trio.http import BoundAddress, create_app, serve_http
from tests.engine.tiny_gguf import write_tiny_llama
from tests.gemma_model import gemma_path
from tests.http.http_harness import run
from tests.neuron_process import free_port, run_neuron, write_config

pytestmark = pytest.mark.slow


@asynccontextmanager
async def empty_node(state: Path, model_dir: Path) -> AsyncIterator[str]:
    from neuron_trio.service.node import Node

    config = NeuronConfig(
        server=ServerConfig(listen=["127.0.0.1:0"], drain_timeout_s=3.0),
        node=NodeConfig(state_dir=str(state), model_dirs=[str(model_dir)]),
        default_models=[],
    )
    node = Node(config)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        bound: list[BoundAddress] = await nursery.start(
            partial(serve_http, create_app(node, config), config, shutdown_trigger=stop.wait)
        )
        node.mark_serving()
        try:
            yield bound[0].url
        finally:
            stop.set()
            nursery.cancel_scope.cancel()


def test_gemma3_loads_at_run_time_and_serves(tmp_path: Path) -> None:
    path = gemma_path()
    bad = write_tiny_llama(tmp_path / "mamba.gguf", arch="mamba")

    async def body() -> None:
        async with (
            empty_node(tmp_path / "state", path.parent) as url,
            httpx.AsyncClient(base_url=url, http2=True, timeout=300) as client,
        ):
            spec = {"name": "gemma3", "source": str(path), "devices": "cpu",
                        "dtype": "float32", "context": 512, "max_batch": 2}  # fmt: skip
            r = await client.post("/v1/models", json=spec)
            assert r.status_code == 201, r.text
            doc = {"model": "gemma3", "prompt": "The capital of France is",
                       "max_tokens": 8, "temperature": 0}  # fmt: skip
            done = (await client.post("/v1/completions", json=doc)).json()
            # transformers' float32 greedy text (tests/engine/data/gemma3_270m_reference.json)
            assert done["choices"][0]["text"] == " the capital of the country of France."
            assert done["usage"]["prompt_tokens"] == 6
            chat = {"model": "gemma3", "messages": [{"role": "user", "content": "hi"}]}
            r = await client.post("/v1/chat/completions", json=chat)
            assert r.status_code == 400 and "no chat template" in r.text  # a base model
        async with (
            empty_node(tmp_path / "state2", tmp_path) as url,
            httpx.AsyncClient(base_url=url, http2=True, timeout=60) as client,
        ):
            spec = {"name": "m", "source": str(bad), "devices": "cpu"}
            r = await client.post("/v1/models", json=spec)
            assert r.status_code == 422, r.text
            assert "architecture 'mamba' is not supported" in r.json()["error"]["message"]

    run(body, timeout=600)


def test_unsupported_default_model_exits_69_naming_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    bad = write_tiny_llama(state / "models" / "m.gguf", arch="mamba")
    config = write_config(
        tmp_path / "neuron.toml",
        server={"listen": [f"127.0.0.1:{free_port()}"]},
        node={"state_dir": state},
        models=[{"name": "m", "source": bad, "devices": "cpu"}],
    )
    proc = run_neuron("serve", "--config", str(config))
    assert proc.returncode == 69, proc.stderr[-2000:]
    assert "architecture 'mamba' is not supported" in proc.stderr
    assert "Traceback" not in proc.stderr
