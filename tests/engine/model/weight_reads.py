"""Which tensors a load dequantises: a spy on `GGUFFile.weight` for the tests."""

from __future__ import annotations

import pytest
import torch

from neuron_trio.engine.gguf.file import GGUFFile


def record_weight_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on (until the test ends), each name `GGUFFile.weight` is called with, in order."""
    read: list[str] = []
    weight = GGUFFile.weight

    def spy(self: GGUFFile, name: str) -> torch.Tensor:
        read.append(name)
        return weight(self, name)

    monkeypatch.setattr(GGUFFile, "weight", spy)
    return read
