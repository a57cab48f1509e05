"""[default_models.speculative]: parsed and bounded; its counts in /metrics and /v1/node."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from neuron_trio.config import SpeculativeConfig, load_config
from neuron_trio.engine.types import EngineStatistics
from neuron_trio.errors import ConfigError
from neuron_trio.service.documents.node_document import SpeculationInfo
from neuron_trio.service.metrics.model import ModelActorStatistics, NodeMetrics

MODEL = "[[default_models]]\nname = 'a'\nsource = 'b'\n"


def _load(tmp_path: Path, text: str) -> SpeculativeConfig | None:
    path = tmp_path / "neuron.toml"
    path.write_text(text)
    return load_config(path, environ={}).default_models[0].speculative


def test_off_by_default_and_parsed(tmp_path: Path) -> None:
    assert _load(tmp_path, MODEL) is None
    table = MODEL + "[default_models.speculative]\nmethod = 'ngram'\nnum_tokens = 6\n"
    assert _load(tmp_path, table) == SpeculativeConfig(method="ngram", num_tokens=6)
    assert _load(tmp_path, MODEL + "speculative = {}\n") == SpeculativeConfig(num_tokens=4)


@pytest.mark.parametrize(
    ("value", "detail"),
    [("num_tokens = 0", ">= 1"), ("num_tokens = 17", "<= 16"), ("method = 'eagle'", "eagle")],
)
def test_bad_values_name_the_key(tmp_path: Path, value: str, detail: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, MODEL + f"[default_models.speculative]\n{value}\n")
    assert "default_models[0].speculative." in str(info.value)
    assert detail in str(info.value)


def test_draft_method_takes_a_source(tmp_path: Path) -> None:
    table = MODEL + "[default_models.speculative]\nmethod = 'draft'\nsource = 'builtin:x'\n"
    assert _load(tmp_path, table) == SpeculativeConfig(method="draft", source="builtin:x")
    for value, detail in (
        ("method = 'draft'", "needs `source`"),
        ("source = 'x.gguf'", 'for method "draft" only'),
        ("method = 'draft'\nsource = ''", "length >= 1"),
    ):
        with pytest.raises(ConfigError) as info:
            _load(tmp_path, MODEL + f"[default_models.speculative]\n{value}\n")
        assert "key default_models[0].speculative" in str(info.value)
        assert detail in str(info.value)


def test_counts_in_metrics_and_node_document() -> None:
    engine = EngineStatistics(
        slots_total=1,
        slots_in_use=0,
        prefilling=0,
        decoding=0,
        steps=3,
        prompt_tokens_total=0,
        generated_tokens_total=0,
        speculative_proposed_tokens=40,
        speculative_accepted_tokens=30,
    )
    stats = ModelActorStatistics(
        name="m", state="serving", queued=0, running=0, slots_total=1, steps=3, failures=0,
        engine=engine,
    )  # fmt: skip
    registry = CollectorRegistry()
    NodeMetrics(registry, lambda: [stats])
    text = generate_latest(registry).decode()
    assert 'neuron_model_speculative_proposed_tokens_total{model="m"} 40.0' in text
    assert 'neuron_model_speculative_accepted_tokens_total{model="m"} 30.0' in text
    info = SpeculationInfo.from_statistics(engine, "ngram", 4)
    assert info.acceptance_rate == 0.75 and info.proposed_tokens == 40
    assert SpeculationInfo.from_statistics(EngineStatistics(0, 0, 0, 0, 0, 0, 0), "ngram", 4) == (
        SpeculationInfo(method="ngram", num_tokens=4)
    )
