"""The native kernel's 5-bit path: Q5_0/Q5_1 codes taken from the file's blocks
(`quant.five_bit_codes`), packed with a fifth bit (`packing.pack_q5`, `tile_high`), and the
product against float32 on both instruction sets and every batch split."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.linear import Q4Linear, Q8Linear, StackedLinear
from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.loader import load_transformer
from tests.engine.model.kernel_isas import ALL_ISAS, isa_fixture
from tests.engine.model.weight_reads import record_weight_reads
from tests.engine.tiny_gguf import write_tiny_llama

KERNEL = packing.native_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the native kernel is not built here")


@pytest.fixture(params=ALL_ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from isa_fixture(request)


def _file_blocks(
    qtype: quant.QType, rows: int, cols: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw blocks, their float32 values by the gguf package's reference) of a random weight."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    t = gguf.GGMLQuantizationType(int(qtype))
    raw = gguf.quants.quantize(w, t)
    return torch.from_numpy(raw.copy()).reshape(-1), torch.from_numpy(
        gguf.quants.dequantize(raw, t).copy()
    )


def _from_codes(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    out_f, groups = scale.shape
    per_group = q.float().reshape(out_f, groups, 32)
    return (per_group * scale.float()[..., None] + minimum.float()[..., None]).reshape(out_f, -1)


@pytest.mark.parametrize("qtype", [quant.QType.Q5_0, quant.QType.Q5_1])
def test_five_bit_codes_give_the_files_weights_exactly(qtype: quant.QType) -> None:
    raw, want = _file_blocks(qtype, 16, 96, seed=int(qtype))
    q, scale, minimum = quant.five_bit_codes(raw, qtype, (16, 96))
    assert q.dtype == torch.uint8 and int(q.max()) <= 31
    assert int(q.max()) > 15  # the fifth bit is in use, not dropped
    torch.testing.assert_close(_from_codes(q, scale, minimum), want, rtol=0, atol=0)


def test_five_bit_codes_refuse_another_format() -> None:
    with pytest.raises(ValueError, match="not a 5-bit format"):
        quant.five_bit_codes(torch.zeros(34, dtype=torch.uint8), quant.QType.Q8_0, (1, 32))


def test_tile_high_sets_the_bit_of_each_weight_in_its_lane() -> None:
    """Row r's weight 4 s + i of group g sits at bit 4 r + i of step s (the kernel's lanes)."""
    high = torch.zeros(16, 64, dtype=torch.uint8)
    high[11, 32 + 4 * 5 + 2] = 1  # tile 1, row 3; group 1; step 5, byte 2
    tiled = packing.tile_high(high)
    assert tuple(tiled.shape) == (2, 2, 8, 4)
    word = tiled[1, 1, 5].numpy().view(np.uint32)[0]
    assert word == 1 << (4 * 3 + 2)
    assert int((tiled != 0).sum()) == 1  # and no other bit anywhere


@needs_kernel
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 8, 15, 16, 21])
@pytest.mark.parametrize(("out_f", "in_f"), [(8, 32), (24, 96), (904, 896)])
def test_five_bit_product_exact_on_int8_representable_inputs(
    isa: str, batch: int, out_f: int, in_f: int, centred: bool, one_pass: bool
) -> None:
    """Inputs whose groups each hold ±127 and integers: the kernel equals the float32 product
    of the file's own Q5_0 weights (a lost fifth bit is off by 16 steps), with the minimum
    stored or (`centred`) implied as -16 · scale; in one pass too (such inputs leave no
    residual for the second)."""
    raw, w = _file_blocks(quant.QType.Q5_0, out_f, in_f, seed=out_f + batch)
    q, scale, minimum = quant.five_bit_codes(raw, quant.QType.Q5_0, (out_f, in_f))
    nibbles, high = packing.pack_q5(q)
    g = torch.Generator().manual_seed(batch)
    x = torch.randint(-127, 128, (batch, in_f), generator=g).float()
    x.view(batch, -1, 32)[:, :, 0] = 127.0
    want = x.double() @ w.double().T
    minimum = None if centred else minimum
    layer = Q4Linear(KERNEL, nibbles, scale, minimum, high=high, one_pass=one_pass)
    assert (layer.minimum is None) == centred
    got = layer(x).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_a_centred_layer_needs_five_bit_codes() -> None:
    if KERNEL is None:
        pytest.skip("the native kernel is not built here")
    nibbles, scale, _ = packing.pack_q4(torch.randn(8, 32))
    with pytest.raises(ValueError, match="5-bit"):
        Q4Linear(KERNEL, nibbles, scale, None)


@needs_kernel
def test_five_bit_fused_rmsnorm_matches_torch(isa: str) -> None:
    raw, w = _file_blocks(quant.QType.Q5_1, 64, 128, seed=3)
    nibbles, high = packing.pack_q5(quant.five_bit_codes(raw, quant.QType.Q5_1, (64, 128))[0])
    _, scale, minimum = quant.five_bit_codes(raw, quant.QType.Q5_1, (64, 128))
    layer = Q4Linear(KERNEL, nibbles, scale, minimum, high=high)
    x, norm = torch.randn(3, 128), torch.rand(128) + 0.5
    want = torch.nn.functional.rms_norm(x, (128,), norm, 1e-6) @ w.T
    got = layer.normed(x, norm, 1e-6, torch.float32)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_stacked_layers_join_their_rows(rows: int) -> None:
    """A Q/K/V held by a 5-bit part and an int8 part equals the one product of both weights,
    at decode (the kernels) and prefill (the parts' dense copies)."""
    raw, w5 = _file_blocks(quant.QType.Q5_0, 32, 64, seed=9)
    q, scale, minimum = quant.five_bit_codes(raw, quant.QType.Q5_0, (32, 64))
    nibbles, high = packing.pack_q5(q)
    w8 = torch.randn(16, 64)
    five = Q4Linear(KERNEL, nibbles, scale, minimum, w5.to(torch.bfloat16), high=high)
    eight = Q8Linear(KERNEL, *packing.pack_q8(w8), w8.to(torch.bfloat16), keep_dtype=True)
    stacked = StackedLinear([five, eight])
    assert (stacked.in_features, stacked.out_features) == (64, 48)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    got = stacked(x).float()
    want = x.float() @ torch.cat((w5, w8)).T
    assert got.shape == (rows, 48)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_largest_codes_times_the_largest_activations_stay_exact(
    isa: str, bits: int, one_pass: bool, batch: int
) -> None:
    """Every weight at its largest code (15, or 31 with the fifth bit) times inputs at ±127 in
    every position: the sums the kernel keeps in narrow integers before widening them
    (groupk_avx2) reach their largest magnitude here, and must not wrap or saturate."""
    out_f, in_f = 16, 96
    q = torch.full((out_f, in_f), (1 << bits) - 1, dtype=torch.uint8)
    nibbles, high = packing.pack_q5(q)
    scale = torch.ones(out_f, in_f // 32, dtype=torch.float16)
    minimum = torch.zeros_like(scale)
    layer = Q4Linear(
        KERNEL, nibbles, scale, minimum, high=high if bits == 5 else None, one_pass=one_pass
    )
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0])[:batch, None]
    x = signs * torch.full((batch, in_f), 127.0)
    x[-1, 32:64] *= -1  # one group of the opposite sign
    want = x.double() @ q.double().T
    torch.testing.assert_close(layer(x).double(), want, rtol=0, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("copies", [False, True])
def test_five_bit_layers_load_without_their_float_weights_unless_a_dense_copy_needs_them(
    tmp_path: Path, copies: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q5_0 projection's layer is made from the file's codes: its float32 weight is never
    dequantised (a 0.5B model's first start spent ~1.5 s on that), except for the bfloat16
    dense copy where the layers keep one, which is then the file's weight."""
    path = write_tiny_llama(tmp_path / "q5.gguf", qtype="Q5_0", seed=4)
    monkeypatch.setenv("NEURON_DENSE_COPIES", "1" if copies else "0")
    read = record_weight_reads(monkeypatch)
    with GGUFFile(path) as gf:
        five_bit = [
            n for n, info in gf.tensors.items() if info.qtype == quant.QType.Q5_0 and "blk." in n
        ]
        model = load_transformer(gf, dtype="auto")
        q_proj = model.layers[0].wqkv
        assert isinstance(q_proj, Q4Linear) and q_proj._buffers["high"] is not None
        assert five_bit
        if not copies:
            assert not set(five_bit) & set(read), "a five-bit weight was dequantised"
        else:
            names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]
            want = torch.cat([gf.weight(n) for n in names]).to(torch.bfloat16)
            assert torch.equal(q_proj._buffers["dense"], want)
