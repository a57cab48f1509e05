"""Packing a large weight a slice of rows at a time gives the bytes of packing it whole."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from neuron_trio.engine.model.load import packing


@pytest.mark.parametrize(
    "pack",
    [packing.pack_int8, packing.pack_q4, packing.pack_q4_symmetric, packing.pack_q8],
    ids=lambda f: f.__name__,
)
def test_a_weight_packed_by_row_chunks_is_packed_as_one(
    pack: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(3)
    # rows of different magnitudes: a scale taken over the wrong rows changes the codes
    weight = torch.randn(40, 64) * torch.logspace(-3, 2, 40)[:, None]
    monkeypatch.setattr(packing, "_CHUNK_ROWS", 1 << 30)
    whole = pack(weight)
    monkeypatch.setattr(packing, "_CHUNK_ROWS", 16)  # 16, 16 and the last 8
    chunked = pack(weight)
    assert len(chunked) == len(whole)
    for a, b in zip(whole, chunked, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
