"""Shared test configuration: GPU tests are skipped, visibly, on machines without CUDA; the
nodes tests run in this process share one model cache (engine.model_cache)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(autouse=True)
def _one_model_cache(shared_model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every in-process Node keeps its models in one session-wide cache, not in its own state
    dir: one entry per model for the whole run (a few hundred MB, not that per test), and
    every load after the first reads it."""
    from neuron_trio.service import node

    monkeypatch.setattr(
        node,
        "model_cache_dir",
        lambda config: shared_model_cache if config.node.model_cache else None,
    )
    yield


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (run bench/gpu_check.sh on one)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
