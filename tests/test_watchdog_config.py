"""`[watchdog]`: the deadlines every model runs under, `[tp]` read as their old name (one
deprecation line), and a model's own `watchdog = {...}` over them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from neuron_trio import config as config_module
from neuron_trio.config import (
    ModelConfig,
    WatchdogConfig,
    config_from_mapping,
    load_config,
    watchdog_for,
)
from neuron_trio.errors import ConfigError


def _load(
    tmp_path: Path, text: str, environ: dict[str, str] | None = None
) -> config_module.NeuronConfig:
    path = tmp_path / "neuron.toml"
    path.write_text(text)
    return load_config(path, environ=environ or {})


def test_the_watchdog_section_sets_every_models_deadlines(tmp_path: Path) -> None:
    config = _load(tmp_path, "[watchdog]\nstep_timeout_s = 7\nprobe_interval_s = 9\n")
    assert config.watchdog == WatchdogConfig(step_timeout_s=7, probe_interval_s=9)
    env = {"NEURON_WATCHDOG_ABORT_DEADLINE_S": "11"}
    assert _load(tmp_path, "", env).watchdog.abort_deadline_s == 11


def test_tp_is_read_as_watchdog_with_one_deprecation_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(config_module, "_tp_alias_warned", False)
    with caplog.at_level(logging.WARNING, logger="neuron_trio.config"):
        first = _load(tmp_path, "[tp]\nstep_timeout_s = 3\n")
        second = _load(tmp_path, "", {"NEURON_TP_ABORT_DEADLINE_S": "5"})
    assert first.watchdog.step_timeout_s == 3 and second.watchdog.abort_deadline_s == 5
    lines = [r.getMessage() for r in caplog.records if "[tp]" in r.getMessage()]
    assert len(lines) == 1 and "[watchdog]" in lines[0]


def test_a_key_in_both_tp_and_watchdog_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"key tp\.step_timeout_s: also set as watchdog"):
        _load(tmp_path, "[tp]\nstep_timeout_s = 3\n[watchdog]\nstep_timeout_s = 4\n")


def test_the_old_variable_still_overrides_the_file(tmp_path: Path) -> None:
    # NEURON_TP_ABORT_DEADLINE_S is in systemd units; a file already renamed must not refuse it.
    env = {"NEURON_TP_ABORT_DEADLINE_S": "30"}
    config = _load(tmp_path, "[watchdog]\nabort_deadline_s = 60\n", env)
    assert config.watchdog.abort_deadline_s == 30


def test_a_bad_value_under_tp_is_named_as_written(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"key tp\.step_timeout_s: "):
        _load(tmp_path, "[tp]\nstep_timeout_s = -1\n")
    env = {"NEURON_TP_STEP_TIMEOUT_S": "-1"}
    with pytest.raises(ConfigError, match=r"tp\.step_timeout_s \(from NEURON_TP_STEP_TIMEOUT_S\)"):
        _load(tmp_path, "", env)


def test_a_model_sets_its_own_deadlines_over_the_nodes() -> None:
    config = config_from_mapping(
        {
            "watchdog": {"step_timeout_s": 10, "abort_deadline_s": 20},
            "default_models": [
                {"name": "slow", "source": "builtin:x", "watchdog": {"step_timeout_s": 120}},
                {"name": "plain", "source": "builtin:x"},
            ],
        },
        origin="test",
        environ={},
    )
    slow, plain = config.default_models
    assert watchdog_for(config, slow) == WatchdogConfig(step_timeout_s=120, abort_deadline_s=20)
    assert watchdog_for(config, plain) == config.watchdog


def test_a_models_unknown_watchdog_key_is_an_error_naming_it() -> None:
    model = {"name": "m", "source": "builtin:x", "watchdog": {"step_timeout": 1}}
    with pytest.raises(ConfigError, match=r"default_models\[0\]\.watchdog\.step_timeout"):
        config_from_mapping({"default_models": [model]}, origin="test", environ={})
    assert ModelConfig(name="m", source="builtin:x").watchdog is None
