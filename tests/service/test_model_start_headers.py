"""service/model_start.py: the node keeps parsed GGUF headers between starts in its
packed-weight cache's directory (engine/gguf/header_memo.STORE), and nowhere when
`[node] weight_cache` is off. (tests/e2e/test_weight_cache_daemon.py: the real daemon.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_trio.config import config_from_mapping
from neuron_trio.engine.gguf import header_memo
from neuron_trio.service.model_start import default_estimator, use_header_store
from tests.engine.tiny_gguf import write_tiny_llama


@pytest.mark.parametrize("weight_cache", [True, False])
def test_the_estimate_stores_the_header_where_the_weight_cache_is(
    tmp_path: Path, weight_cache: bool
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    path = write_tiny_llama(models / "m.gguf")
    config = config_from_mapping(
        {
            "node": {
                "state_dir": str(tmp_path / "state"),
                "model_dirs": [str(models)],
                "weight_cache": weight_cache,
            },
            "default_models": [{"name": "m", "source": str(path), "devices": "cpu"}],
        },
        origin="test",
        environ={},
    )
    header_memo.MEMO.clear()
    use_header_store(config)  # as the daemon does before its node starts
    estimate = default_estimator(config.default_models[0], path, False)
    assert estimate.total_bytes > 0
    stored = list((config.weight_cache_path / "headers").glob(f"*{header_memo.STORE_SUFFIX}"))
    assert len(stored) == (1 if weight_cache else 0)
    assert not list(tmp_path.rglob(f"*{header_memo.STORE_SUFFIX}"))[len(stored) :]
