"""The real Node behind the real app, for the HTTP tests: `real_node` serves the built-in model
(SmolLM2-135M) on the CPU (slow) and `builtin_available` says whether its wheel is installed;
`bare_node` serves no model at all, for files loaded at run time. Each yields its base URL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from neuron_trio.config import ModelConfig, NeuronConfig, NodeConfig, ServerConfig
from neuron_trio.errors import SourceError
from tests.http.http_harness import serving_node

MODEL = "smollm2-135m"


def builtin_available() -> bool:
    from neuron_trio.engine.gguf.builtin import builtin_model_path

    try:
        builtin_model_path()
    except SourceError:
        return False
    return True


@asynccontextmanager
async def real_node(state: Path) -> AsyncIterator[str]:
    from neuron_trio.service.node import Node

    spec = ModelConfig(
        name=MODEL, source=f"builtin:{MODEL}", devices="cpu", max_batch=2, context=512
    )
    config = NeuronConfig(
        server=ServerConfig(listen=["127.0.0.1:0"], drain_timeout_s=3.0),
        node=NodeConfig(state_dir=str(state), model_dirs=[str(state)]),
        default_models=[spec],
    )
    node = Node(config)
    async with serving_node(node, config) as url:
        yield url


@asynccontextmanager
async def bare_node(
    models: Path, host_memory: int | None = None, **node: Any
) -> AsyncIterator[str]:
    from neuron_trio.service.node import Node

    config = NeuronConfig(
        server=ServerConfig(listen=["127.0.0.1:0"], drain_timeout_s=2.0),
        node=NodeConfig(state_dir=str(models.parent), model_dirs=[str(models)], **node),
        default_models=[],
    )
    n = Node(config, host_memory=None if host_memory is None else lambda: host_memory)
    async with serving_node(n, config) as url:
        yield url
