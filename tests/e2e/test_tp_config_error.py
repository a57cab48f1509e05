"""A default model whose tp does not divide its heads: exit 78 (systemd will not restart it),
naming both numbers (the executor's ConfigError behind it: tests/executor/test_executor.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.neuron_process import run_neuron, write_config

pytestmark = pytest.mark.slow


def test_default_model_with_a_tp_that_does_not_divide_exits_78(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "neuron.toml",
        server={"listen": ["127.0.0.1:1"]},
        node={"state_dir": tmp_path / "state"},
        models=[{"name": "two", "source": "builtin:smollm2-135m", "tp": 2, "devices": "cpu"}],
    )
    done = run_neuron("serve", "--config", str(config))
    assert done.returncode == 78, done.stderr
    # the built-in model has 9 attention heads and 3 KV heads
    message = "model 'two': tp = 2 does not divide 9 attention heads / 3 KV heads"
    assert message in done.stderr, done.stderr
