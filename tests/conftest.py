"""Shared test configuration: GPU tests are skipped, visibly, on machines without CUDA; the
daemons a session starts share one packed-weight cache (tests/neuron_process.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from neuron_trio.engine.gguf import header_memo
from tests import neuron_process


@pytest.fixture(scope="session", autouse=True)
def _shared_weight_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    neuron_process.SHARED_WEIGHT_CACHE = tmp_path_factory.mktemp("weight-cache")
    yield
    neuron_process.SHARED_WEIGHT_CACHE = None


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


@pytest.fixture(autouse=True)
def _no_header_store() -> Iterator[None]:
    """A test that points the parsed-header store (engine/gguf/header_memo.STORE) at its tmp
    dir, e.g. through the node's estimator, leaves it pointing nowhere for the next test."""
    yield
    header_memo.STORE.use(None)
