"""A runtime load's draft model is fetched under the same hub limits as the model itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from neuron_trio.config import ModelConfig, SpeculativeConfig
from neuron_trio.errors import SourceError
from neuron_trio.service import model_start
from neuron_trio.service.sources import HubLimits

LIMITS = HubLimits(("acme/*",), 1 << 20)


def test_a_runtime_loads_draft_is_resolved_under_the_hub_limits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, Any]] = []

    def resolve(source: str, config: Any, **kwargs: Any) -> Path:
        calls.append((source, kwargs.get("limits")))
        if source.startswith("hf:evil/"):
            raise SourceError(f"{source}: repo not allowed")
        return tmp_path / "model.gguf"

    monkeypatch.setattr(model_start, "resolve_source", resolve)
    spec = ModelConfig(
        name="m",
        source="hf:acme/tiny/tiny.Q4_0.gguf",
        speculative=SpeculativeConfig(method="draft", source="hf:evil/big/big.gguf"),
    )

    async def place() -> None:
        await model_start.place_model(
            spec,
            config=None,  # type: ignore[arg-type]  # only handed to resolve_source
            gpus=None,
            estimator=lambda *a: (_ for _ in ()).throw(AssertionError("estimated past the draft")),
            host_memory=lambda: None,
            progress=lambda _: None,
            on_bytes=None,
            hub_limits=LIMITS,
        )

    with pytest.raises(SourceError):
        trio.run(place)
    assert calls == [("hf:acme/tiny/tiny.Q4_0.gguf", LIMITS), ("hf:evil/big/big.gguf", LIMITS)]
