"""The native CPU kernel (`engine/model/_cpu_kernel.c`): its products, attention, RoPE and refinement
against float32 torch.

Both instruction sets this CPU has are checked (a VNNI CPU also runs the AVX2 path), every
batch size the kernel splits differently (1, 2, 3, 4, 5, 8, 16 rows), bfloat16 and float32
in/out, and shapes whose rows and groups are not powers of two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import gguf
import numpy as np
import pytest
import torch

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.model.linear import NATIVE_DENSE_MIN_ROWS, Q4Linear, Q8Linear
from neuron_trio.engine.model.load import packing
from tests.engine.model.kernel_isas import ALL_ISAS, isa_fixture, usable_isas

KERNEL = packing.native_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the native kernel is not built here")


@pytest.fixture(params=ALL_ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from isa_fixture(request)


def _dequantised(nibbles: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """pack_q4's layout back to float32, written independently of the kernel."""
    out_f, groups = scale.shape
    per_group = nibbles.reshape(out_f, groups, 16)
    q = torch.cat((per_group & 0x0F, per_group >> 4), dim=-1).float()  # elements 0..15, 16..31
    scale, minimum = scale.float(), minimum.float()
    return (q * scale[..., None] + minimum[..., None]).reshape(out_f, groups * 32)


def _dequantised_symmetric(nibbles: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """pack_q4_symmetric's layout back to float32: scale · (q - 8)."""
    return _dequantised(nibbles, scale, -8.0 * scale.float())


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
def test_packing_keeps_the_formats_blocks_exactly(kind: str) -> None:
    """A Q4_1 weight (the built-in model's format) comes back from pack_q4 unchanged, and a
    Q4_0 weight from pack_q4_symmetric (the coarse head's kind: Q4_0's grid)."""
    w = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, kind)
    deq = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, t), t).copy())
    if kind == "Q4_1":
        back = _dequantised(*packing.pack_q4(deq))
    else:
        back = _dequantised_symmetric(*packing.pack_q4_symmetric(deq))
    torch.testing.assert_close(back, deq, rtol=0, atol=1e-6 * float(deq.abs().max()))


@needs_kernel
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 8, 15])
@pytest.mark.parametrize(("out_f", "in_f"), [(8, 32), (24, 96), (960, 576), (576, 1536)])
def test_exact_on_int8_representable_inputs(isa: str, batch: int, out_f: int, in_f: int) -> None:
    """Inputs whose groups each hold ±127 and integers: int8 quantisation loses nothing, so
    the kernel must equal the float32 product up to float rounding (a wrong nibble, scale,
    tile or row would be off by whole units)."""
    g = torch.Generator().manual_seed(out_f * 7 + batch)
    nibbles, scale, minimum = packing.pack_q4(torch.randn(out_f, in_f, generator=g))
    x = torch.randint(-127, 128, (batch, in_f), generator=g).float()
    x.view(batch, -1, 32)[:, :, 0] = 127.0  # every group's scale is exactly 1
    want = x.double() @ _dequantised(nibbles, scale, minimum).double().T
    got = Q4Linear(KERNEL, nibbles, scale, minimum)(x).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 4, 7, 16])
def test_close_to_float32_on_real_activations(isa: str, dtype: torch.dtype, batch: int) -> None:
    """Gaussian inputs: int8 activations keep the product within 2% of its largest value, in
    the input's dtype; 16 rows without a dense copy still take the kernel."""
    g = torch.Generator().manual_seed(batch)
    nibbles, scale, minimum = packing.pack_q4(torch.randn(96, 192, generator=g))
    x = torch.randn(batch, 192, generator=g)
    want = x @ _dequantised(nibbles, scale, minimum).T
    got = Q4Linear(KERNEL, nibbles, scale, minimum)(x.to(dtype))
    assert got.dtype == dtype and got.shape == (batch, 96)
    assert float((got.float() - want).abs().max()) < 0.02 * float(want.abs().max())


def _five_bit_layer(out_f: int, in_f: int, g: torch.Generator, one_pass: bool = False) -> Q4Linear:
    """A Q4Linear of random 5-bit codes, its minimum -16 · scale (Q5_0's) stored."""
    assert KERNEL is not None
    nibbles, high = packing.pack_q5(torch.randint(0, 32, (out_f, in_f), generator=g))
    scale = (torch.rand(out_f, in_f // 32, generator=g) / 16).half()
    minimum = (-16 * scale.float()).half()
    return Q4Linear(KERNEL, nibbles, scale, minimum, high=high, one_pass=one_pass)


@needs_kernel
@pytest.mark.parametrize(
    "weights",
    [
        "4-bit",
        "4-bit one pass",
        "4-bit coarse",
        "5-bit",
        "5-bit one pass",
        "int8",
        "int8 per 32",
        "int8 per 32 one pass",
    ],
)
@pytest.mark.parametrize(("out_f", "in_f"), [(24, 96), (960, 576), (16, 8224)])
def test_every_row_the_same_bits_at_any_batch_and_on_either_instruction_set(
    weights: str, out_f: int, in_f: int
) -> None:
    """A row's output does not depend on the rows beside it (the 8-, 4-, 2- and 1-row paths,
    and an odd last tile, do the same arithmetic in the same order; 5-bit weights that
    several blocks of rows read are unpacked once, up to UNPACKED_GROUPS groups of inputs:
    8,224 inputs are past it) nor on the instruction set: batching never changes a
    sequence's tokens."""
    assert KERNEL is not None
    g = torch.Generator().manual_seed(out_f)
    w = torch.randn(out_f, in_f, generator=g)
    layer: torch.nn.Module
    if weights.startswith("5-bit"):
        layer = _five_bit_layer(out_f, in_f, g, one_pass=weights.endswith("one pass"))
    elif weights == "4-bit coarse":
        layer = Q4Linear(KERNEL, *packing.pack_q4_symmetric(w), None, coarse=True)
    elif weights.startswith("4-bit"):
        layer = Q4Linear(KERNEL, *packing.pack_q4(w), one_pass=weights.endswith("one pass"))
    elif weights.startswith("int8 per 32"):
        layer = Q8Linear(KERNEL, *quant.grid8(w), one_pass=weights.endswith("one pass"))
    else:
        layer = Q8Linear(KERNEL, *packing.pack_q8(w))
    x = torch.randn(21, in_f, generator=g)  # more than 16 rows
    alone = torch.cat([layer(x[i : i + 1]) for i in range(21)])
    default = KERNEL.isa()
    try:
        for isa in usable_isas():
            assert KERNEL.use(isa)
            assert torch.equal(layer(x), alone), isa
    finally:
        KERNEL.use(default)


@needs_kernel
@pytest.mark.parametrize("weights", ["4-bit", "5-bit", "int8", "int8 per 32"])
@pytest.mark.parametrize(("out_f", "batch"), [(8, 1), (24, 8), (960, 1), (960, 8), (968, 9)])
def test_every_output_once_and_the_same_bits_on_any_number_of_threads(
    weights: str, out_f: int, batch: int
) -> None:
    """The threads split a product's tiles (or pairs of tiles) into runs (TILES_SHARED):
    with more threads than tiles or than cores, and with an odd last tile, every output is
    computed, with the bits of one thread alone. A product of other inputs runs before each
    call, so an output left out would hold its values."""
    assert KERNEL is not None
    in_f = 96
    g = torch.Generator().manual_seed(out_f + batch)
    w = torch.randn(out_f, in_f, generator=g)
    layer: torch.nn.Module
    if weights == "int8":
        layer = Q8Linear(KERNEL, *packing.pack_q8(w))
    elif weights == "int8 per 32":
        layer = Q8Linear(KERNEL, *quant.grid8(w))
    elif weights == "5-bit":
        layer = _five_bit_layer(out_f, in_f, g)
    else:
        layer = Q4Linear(KERNEL, *packing.pack_q4(w))
    x, other = torch.randn(2, batch, in_f, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x)
        assert not torch.equal(layer(other), alone)
        for n in (2, 3, 7):
            torch.set_num_threads(n)
            for _ in range(5):  # who takes over what differs from call to call
                layer(other)
                assert torch.equal(layer(x), alone), n
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("batch", [1, 2, 8])
def test_one_pass_halves_the_activations_precision_and_nothing_else(isa: str, batch: int) -> None:
    """`one_pass` (a coarse pass, as the head's `coarse` kind is): on inputs int8 keeps exactly (each group's largest
    ±127, integers) it equals the two-pass product; on others it is coarser than two passes
    but still close to float32 (one int8 rounding of the input per group)."""
    g = torch.Generator().manual_seed(batch)
    w = torch.randn(64, 128, generator=g)
    nibbles, scale, minimum = packing.pack_q4(w)
    one = Q4Linear(KERNEL, nibbles, scale, minimum, one_pass=True)
    two = Q4Linear(KERNEL, nibbles, scale, minimum)
    exact = torch.randint(-127, 128, (batch, 128), generator=g).float()
    exact.view(batch, -1, 32)[:, :, 0] = 127.0
    torch.testing.assert_close(one(exact), two(exact), rtol=1e-6, atol=1e-3)
    x = torch.randn(batch, 128, generator=g)
    want = x.double() @ _dequantised(nibbles, scale, minimum).double().T
    err_one = float((one(x).double() - want).abs().max())
    err_two = float((two(x).double() - want).abs().max())
    assert err_two < err_one < 0.05 * float(want.abs().max())


@needs_kernel
@pytest.mark.parametrize("batch", [1, 2, 3, 8, 9])
def test_int8_per_32_is_the_product_of_its_weights_in_two_passes(isa: str, batch: int) -> None:
    """int8 codes with a float16 scale per row and group of 32 (quant.int8_codes' layer, for
    Q8_0, IQ4_NL, IQ4_XS, Q3_K, Q2_K, Q6_K): the float product of exactly those weights, but
    for the activations' two int8 passes (~15 bits); one pass is ~2^-8 coarser. The row-scale
    int8 layer it replaces was ~1% off (the weights rounded to one scale a row)."""
    g = torch.Generator().manual_seed(batch)
    w = torch.randn(48, 256, generator=g) * torch.rand(48, 8, 1, generator=g).repeat(
        1, 1, 32
    ).reshape(48, 256)  # groups of very different sizes, as a file's blocks
    q, scale = quant.grid8(w)
    exact = (q.float().reshape(48, 8, 32) * scale.float()[..., None]).reshape(48, 256)
    x = torch.randn(batch, 256, generator=g)
    want = x.double() @ exact.double().T

    def error(layer: torch.nn.Module) -> float:
        return float((layer(x).double() - want).norm() / want.norm())

    two, one = error(Q8Linear(KERNEL, q, scale)), error(Q8Linear(KERNEL, q, scale, one_pass=True))
    assert two < 1e-4 < 1e-3 < one < 2e-2
    rows = Q8Linear(KERNEL, *packing.pack_q8(exact))  # the old kind, one scale a row
    assert error(rows) > 50 * two


@needs_kernel
def test_dropping_the_residual_pass_gives_the_one_pass_layers_bits(isa: str) -> None:
    """drop_residual_pass (bench/bench_decode.py's --one-pass) turns a two-pass layer into
    `one_pass`'s, bit for bit, and changes its output (4- and 5-bit weights, int8 per 32)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 256, generator=g)
    four = packing.pack_q4(torch.randn(64, 256, generator=g))
    grouped = quant.grid8(torch.randn(64, 256, generator=g))
    builds: list[Callable[[bool], Q4Linear | Q8Linear]] = [
        lambda one_pass: Q4Linear(KERNEL, *four, one_pass=one_pass),
        lambda one_pass: _five_bit_layer(64, 256, torch.Generator().manual_seed(3), one_pass),
        lambda one_pass: Q8Linear(KERNEL, *grouped, one_pass=one_pass),
    ]
    for build in builds:
        layer, want = build(False), build(True)(x)
        before = layer(x)
        layer.drop_residual_pass()
        assert torch.equal(layer(x), want)
        assert not torch.equal(before, want)


@needs_kernel
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_coarse_kind_scales_each_row_once(isa: str, batch: int) -> None:
    """`coarse` (the head's pass): on rows int8 keeps exactly with one scale per row (integers,
    each row's largest ±127) the product is the dequantised weights' to float32 rounding; on
    others one int8 rounding of the whole row, still close to float32. The kind refuses the
    weights it is not for."""
    assert KERNEL is not None
    g = torch.Generator().manual_seed(batch)
    w = torch.randn(64, 128, generator=g)
    nibbles, scale = packing.pack_q4_symmetric(w)
    layer = Q4Linear(KERNEL, nibbles, scale, None, out_dtype=torch.float32, coarse=True)
    dense = _dequantised_symmetric(nibbles, scale).double()
    exact = torch.randint(-127, 128, (batch, 128), generator=g).float()
    exact[:, 5] = 127.0
    torch.testing.assert_close(
        layer(exact).double(), exact.double() @ dense.T, rtol=1e-6, atol=1e-3
    )
    x = torch.randn(batch, 128, generator=g)
    want = x.double() @ dense.T
    err = float((layer(x).double() - want).abs().max())
    assert 0 < err < 0.05 * float(want.abs().max())
    with pytest.raises(ValueError, match="coarse kind"):
        Q4Linear(KERNEL, *packing.pack_q4(w), coarse=True)


@needs_kernel
def test_rows_of_three_dimensions_and_the_dense_path() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g)
    nibbles, scale, minimum = packing.pack_q4(w)
    dense = _dequantised(nibbles, scale, minimum)
    layer = Q4Linear(KERNEL, nibbles, scale, minimum, dense=dense.to(torch.bfloat16))
    x = torch.randn(2, 3, 64, generator=g)
    got = layer(x)  # 6 rows: the kernel
    assert got.shape == (2, 3, 16)
    want = x @ dense.T
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())
    many = torch.randn(NATIVE_DENSE_MIN_ROWS, 64, generator=g)  # the bfloat16 copy
    torch.testing.assert_close(
        layer(many), (many.bfloat16() @ dense.bfloat16().T).float(), rtol=0.02, atol=0.05
    )


@needs_kernel
def test_bad_shapes_are_refused() -> None:
    assert KERNEL is not None
    y = torch.empty(1, 8)
    x = torch.empty(1, 33)
    with pytest.raises(ValueError, match="multiple of 32"):
        KERNEL.matmul(x.data_ptr(), 1, 33, 0, 0, 0, 8, y.data_ptr(), 0, 0, 0, 0.0)
    with pytest.raises(ValueError, match="prologue"):  # RMSNorm without its weight
        KERNEL.matmul(x.data_ptr(), 1, 32, 0, 0, 0, 8, y.data_ptr(), 0, 1, 0, 1e-5)
    with pytest.raises(ValueError, match="group sums"):  # int8 weights without their sums
        KERNEL.matmul(x.data_ptr(), 1, 32, 0, 0, 0, 8, y.data_ptr(), 0, 0, 0, 0.0)
    with pytest.raises(TypeError):
        KERNEL.matmul(1, 2)


def test_the_kernel_is_built_where_it_can_be() -> None:
    """In CI on x86-64 with a C compiler, `pip install` must have built the kernel (it is
    optional, so a broken build would otherwise only show as skipped tests)."""
    import os
    import platform
    import shutil

    if os.environ.get("CI") != "true" or platform.machine() != "x86_64" or not shutil.which("cc"):
        pytest.skip("only checked in CI on x86-64 with a C compiler")
    assert KERNEL is not None, "engine/model/_cpu_kernel.c was not built: see pip's output"


@needs_kernel
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 8, 15])
@pytest.mark.parametrize(("out_f", "in_f"), [(8, 32), (24, 96), (256, 576)])
def test_int8_weights_exact_on_int8_representable_inputs(
    isa: str, batch: int, out_f: int, in_f: int
) -> None:
    """The int8 path (the head's coarse pass) on inputs int8 quantisation keeps exactly: equal
    to the float32 product of the dequantised weight, in float32 whatever the input dtype."""
    g = torch.Generator().manual_seed(out_f + batch)
    weight, scale = packing.pack_q8(torch.randn(out_f, in_f, generator=g))
    x = torch.randint(-127, 128, (batch, in_f), generator=g).float()
    x.view(batch, -1, 32)[:, :, 0] = -127.0  # every group's scale is exactly 1
    want = x.double() @ (weight.double() * scale.double()[:, None]).T
    for dtype in (torch.float32, torch.bfloat16):  # these integers are exact in bfloat16
        got = Q8Linear(KERNEL, weight, scale)(x.to(dtype))
        assert got.dtype == torch.float32
        torch.testing.assert_close(
            got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())
        )


@needs_kernel
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_fused_norm_and_activations_match_torch(isa: str, batch: int) -> None:
    """`normed` (RMSNorm inside the kernel) and `gated` (SiLU or GELU-tanh times up) against
    the same ops in torch followed by the float32 product: within int8 quantisation (2%)."""
    g = torch.Generator().manual_seed(10 + batch)
    nibbles, scale, minimum = packing.pack_q4(torch.randn(64, 96, generator=g))
    layer = Q4Linear(KERNEL, nibbles, scale, minimum)
    w = _dequantised(nibbles, scale, minimum)
    x = 3.0 * torch.randn(batch, 96, generator=g) + 1.0
    norm = torch.rand(96, generator=g) + 0.5
    want = torch.nn.functional.rms_norm(x, (96,), norm, 1e-5) @ w.T
    got = layer.normed(x, norm, 1e-5, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) < 0.02 * float(want.abs().max())
    gate_up = 4.0 * torch.randn(batch, 192, generator=g)  # gates far into both tails
    for gelu in (False, True):
        gate = gate_up[:, :96]
        act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else F_silu(gate)
        # the fused activation feeds the product exactly what torch's would (the product
        # itself is checked above)
        want = layer(act * gate_up[:, 96:])
        got = layer.gated(gate_up, gelu)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


def F_silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "length"), [(1, 1), (1, 37), (3, 8), (8, 130)])
def test_decode_attention_matches_sdpa(dtype: torch.dtype, batch: int, length: int) -> None:
    """The native decode attention against SDPA in float32, on views of a cache-like tensor
    (strided, as Block reads K/V), with an additive mask that hides each row's tail (-inf: no
    weight at all, even for garbage keys) and without a mask."""
    from neuron_trio.engine.model.attention import native_attention, native_attention_fits

    g = torch.Generator().manual_seed(batch * 1000 + length)
    kv, groups, d, context = 3, 3, 64, 160
    cache = torch.randn(batch + 2, 2 * kv, context, d, generator=g).to(dtype)
    rows = cache[1 : batch + 1, :, :length]  # [B, 2KV, L, D], a strided view
    keys, values = rows[:, :kv], rows[:, kv:]
    qkv = torch.randn(batch, kv * groups + 2 * kv, d, generator=g).to(dtype)
    q = qkv[:, : kv * groups].reshape(batch, kv, groups, d)  # a view, as Block makes it
    ends = torch.randint(1, length + 1, (batch,), generator=g)
    attend = torch.arange(length)[None, :] < ends[:, None]
    mask = torch.zeros(batch, length, dtype=dtype).masked_fill_(~attend, float("-inf"))
    mask = mask[:, None, None]  # [B, 1, 1, L]
    for m in (None, mask):
        if m is not None:  # garbage where the mask hides keys: it must get no weight at all
            hidden = ~attend[:, None, :, None].expand(-1, 2 * kv, -1, d)
            cache[1 : batch + 1, :, :length][hidden] = 1e4
        assert native_attention_fits(q, keys, values, m, None)
        got = native_attention(KERNEL, q, keys, values, m, None)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float(), keys.float(), values.float(), attn_mask=None if m is None else m.float()
        ).reshape(batch, -1)
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert not native_attention_fits(q, keys, values, mask.bool(), None)  # bool: SDPA's
    assert not native_attention_fits(q, keys, values, mask, 50.0)  # soft-capped: SDPA's


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "kv", "groups", "d", "length"),
    [(1, 3, 3, 64, 1), (8, 3, 3, 64, 130), (3, 2, 5, 72, 45), (2, 1, 16, 256, 9), (4, 2, 1, 8, 7)],
)
def test_decode_attention_has_the_same_bits_on_either_instruction_set(
    dtype: torch.dtype, batch: int, kv: int, groups: int, d: int, length: int
) -> None:
    """The AVX-512 attention (two keys a vector, 16 dimensions of the value sums) does the
    256-bit version's arithmetic lane for lane: the same bits, for odd head counts, a head
    size of 8 mod 16, a last group of fewer than 4 keys, masks and token rows."""
    from neuron_trio.engine.model.attention import native_attention

    assert KERNEL is not None
    g = torch.Generator().manual_seed(batch * 31 + d)
    pool_tokens = 256
    pool = torch.randn(1, 2 * kv, pool_tokens, d, generator=g).to(dtype)
    q = torch.randn(batch, kv, groups, d, generator=g).to(dtype)
    rows = torch.stack([torch.randperm(pool_tokens, generator=g)[:length] for _ in range(batch)])
    ends = torch.randint(1, length + 1, (batch,), generator=g)
    attend = torch.arange(length)[None, :] < ends[:, None]
    mask = torch.zeros(batch, length, dtype=dtype).masked_fill_(~attend, float("-inf"))
    keys, values = pool[:, :kv], pool[:, kv:]
    default, outputs = KERNEL.isa(), []
    try:
        for isa in usable_isas():
            assert KERNEL.use(isa)
            got = native_attention(KERNEL, q, keys, values, mask[:, None, None], None, rows=rows)
            outputs.append(got)
    finally:
        KERNEL.use(default)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
    assert bool(outputs[0].isfinite().all())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_row_alone_has_its_bits_beside_longer_rows(isa: str, dtype: torch.dtype) -> None:
    """A row of `end` keys alone (no mask) and the same row in a batch whose longest row reads
    more keys (its keys past `end` masked with -inf): the same bits, for every end not a
    multiple of 8. A speculative verification runs k + 1 such rows where decoding ran one:
    the softmax's sum must not change with how many masked keys follow a row's own."""
    from neuron_trio.engine.model.attention import native_attention

    g = torch.Generator().manual_seed(17)
    kv, groups, d, length = 2, 3, 64, 53
    pool = (3.0 * torch.randn(1, 2 * kv, length, d, generator=g)).to(dtype)
    keys, values = pool[:, :kv], pool[:, kv:]
    q = (3.0 * torch.randn(2, kv, groups, d, generator=g)).to(dtype)
    for end in range(33, length):
        alone = native_attention(
            KERNEL, q[:1], keys[..., :end, :], values[..., :end, :], None, None
        )
        mask = torch.zeros(2, 1, 1, length, dtype=dtype)
        mask[0, ..., end:] = float("-inf")  # row 0 ends at `end`; row 1 reads all the keys
        both = native_attention(KERNEL, q, keys.expand(2, -1, -1, -1),
                                values.expand(2, -1, -1, -1), mask, None)  # fmt: skip
        assert torch.equal(both[:1], alone), f"end {end}"


@needs_kernel
def test_loader_picks_the_native_kernel_only_where_it_fits() -> None:
    """4-bit weights take Q4Linear; weights beyond float16's range (its scales) or with rows
    not a multiple of its tile take torch's int4 kernel."""
    from neuron_trio.engine.model.linear import Int4Linear
    from neuron_trio.engine.model.load.loader import make_linear

    cpu = torch.device("cpu")
    w = torch.randn(32, 64)
    assert type(make_linear(w, "cpu-int", cpu, four_bit=True)) is Q4Linear
    assert type(make_linear(w * 1e5, "cpu-int", cpu, four_bit=True)) is Int4Linear
    assert type(make_linear(torch.randn(20, 64), "cpu-int", cpu, four_bit=True)) is not Q4Linear


@pytest.mark.parametrize(
    ("forced", "copies"), [(None, False), ("1", True), ("0", False), ("yes", False)]
)
def test_the_native_layers_keep_a_prefill_copy_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, forced: str | None, copies: bool
) -> None:
    """packing.native_dense_copies: only NEURON_DENSE_COPIES=1, AMX's bfloat16 tiles or not
    (memory first: issue 49). The native layers follow it; torch's int kernels keep their copy
    always (their large-batch GEMM is far slower than a dense one)."""
    from neuron_trio.engine.model.linear import Int4Linear
    from neuron_trio.engine.model.load.loader import make_linear

    if forced is None:
        monkeypatch.delenv("NEURON_DENSE_COPIES", raising=False)
    else:
        monkeypatch.setenv("NEURON_DENSE_COPIES", forced)
    assert packing.native_dense_copies() is copies
    if KERNEL is None:
        return
    g = torch.Generator().manual_seed(3)
    cpu, w = torch.device("cpu"), torch.randn(32, 64, generator=g)
    native = make_linear(w, "cpu-int", cpu, four_bit=True)
    int8 = make_linear(w, "cpu-int", cpu, four_bit=False)
    torch_int4 = make_linear(w * 1e5, "cpu-int", cpu, four_bit=True)
    assert type(native) is Q4Linear and type(int8) is Q8Linear and type(torch_int4) is Int4Linear
    assert (native.dense is not None) is copies and (int8.dense is not None) is copies
    assert torch_int4.dense is not None
    x = torch.randn(NATIVE_DENSE_MIN_ROWS, 64, generator=g)  # a prefill chunk
    # the copy's GEMM (the weight in bfloat16), or the kernel (its 4-bit weight, ~float32)
    held = w.to(torch.bfloat16).float() if copies else _dequantised(*packing.pack_q4(w))
    want = x @ held.T
    assert float((native(x) - want).abs().max()) < 0.02 * float(want.abs().max())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "length"), [(1, 5), (3, 40), (8, 130)])
def test_decode_attention_through_token_rows_matches_a_gather(
    dtype: torch.dtype, batch: int, length: int
) -> None:
    """With `rows`, the kernel reads K/V in place from a paged pool `[2KV, pool, D]` at each
    row's token rows (scattered, as blocks are): the same as SDPA on the gathered rows."""
    from neuron_trio.engine.model.attention import native_attention

    g = torch.Generator().manual_seed(batch * 7 + length)
    kv, groups, d, pool_tokens = 3, 3, 64, 2048
    pool = torch.randn(2 * kv, pool_tokens, d, generator=g).to(dtype)
    rows = torch.stack([torch.randperm(pool_tokens, generator=g)[:length] for _ in range(batch)])
    qkv = torch.randn(batch, kv * groups + 2 * kv, d, generator=g).to(dtype)
    q = qkv[:, : kv * groups].reshape(batch, kv, groups, d)
    ends = torch.randint(1, length + 1, (batch,), generator=g)
    attend = torch.arange(length)[None, :] < ends[:, None]
    mask = torch.zeros(batch, length, dtype=dtype).masked_fill_(~attend, float("-inf"))
    mask = mask[:, None, None]  # [B, 1, 1, L]
    gathered = pool[:, rows].permute(1, 0, 2, 3)  # [B, 2KV, L, D]
    view = pool.unsqueeze(0)
    got = native_attention(KERNEL, q, view[:, :kv], view[:, kv:], mask, None, rows=rows)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), gathered[:, :kv].float(), gathered[:, kv:].float(), attn_mask=mask.float()
    ).reshape(batch, -1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # the rows do matter: other token rows (other keys) give other outputs
    shifted = (rows + 1) % pool_tokens
    other = native_attention(KERNEL, q, view[:, :kv], view[:, kv:], mask, None, rows=shifted)
    assert not torch.allclose(other.float(), want, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_refine_recomputes_each_rows_best_logits_exactly(dtype: torch.dtype) -> None:
    """`refine`: each row's k best coarse logits replaced by their exact float32 dot products
    with the table, the rest untouched; a row alone gets the same bits as in a batch."""
    assert KERNEL is not None
    g = torch.Generator().manual_seed(5)
    vocab, dim, k = 1003, 72, 37  # neither a multiple of 8 nor of 16
    coarse = torch.randn(5, vocab, generator=g)
    table = torch.randn(vocab, dim, generator=g)
    x = torch.randn(5, dim, generator=g).to(dtype)

    def refine(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        n = rows.shape[0]
        KERNEL.refine(out.data_ptr(), n, vocab, rows.data_ptr(), int(dtype == torch.bfloat16),
                      table.data_ptr(), dim, k)  # fmt: skip
        return out

    got = refine(coarse, x)
    top = coarse.topk(k, dim=-1).indices
    exact = (x.double() @ table.double().T).float()
    want = coarse.scatter(1, top, exact.gather(1, top))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, coarse.scatter(1, top, got.gather(1, top)))  # the tail untouched
    assert torch.equal(refine(coarse[2:3], x[2:3].contiguous()), got[2:3])
    with pytest.raises(ValueError, match="refine: bad shape"):
        KERNEL.refine(got.data_ptr(), 5, vocab, x.data_ptr(), 0, table.data_ptr(), dim, vocab + 1)


def _refined_reference(coarse: torch.Tensor, exact: torch.Tensor, k: int) -> torch.Tensor:
    """coarse with each row's k best replaced by exact: best by logit, then the lower index."""
    order = torch.sort(-coarse, dim=-1, stable=True).indices[:, :k]
    return coarse.scatter(1, order, exact.gather(1, order))


@needs_kernel
@pytest.mark.parametrize(
    "case", ["ties", "ascending", "all equal", "a nan", "few reach the sample's threshold"]
)
def test_refine_over_a_large_vocabulary_picks_the_same_k_best(case: str) -> None:
    """Over a vocabulary large enough for the sampled threshold, `refine` still recomputes
    exactly the k best (ties to the lower index), and rows where the sample would mislead
    (everything tied, a NaN, a threshold too few reach) take the whole row instead."""
    assert KERNEL is not None
    g = torch.Generator().manual_seed(9)
    rows, vocab, dim, k = 3, 40_000, 64, 256
    table = torch.randn(vocab, dim, generator=g)
    x = torch.randn(rows, dim, generator=g)
    coarse = (torch.randn(rows, vocab, generator=g) * 4).round() / 4  # many ties everywhere
    if case == "ascending":  # each logit beats the ones before it: the worst order for a heap
        coarse = torch.arange(vocab, dtype=torch.float32).repeat(rows, 1)
    elif case == "all equal":
        coarse = torch.zeros(rows, vocab)
    elif case == "a nan":
        coarse[1, 777] = float("nan")
    elif case == "few reach the sample's threshold":
        # the sampled logits (every 16th) high, the rest low: fewer than k reach the sample's
        # threshold, so the threshold must not be used
        coarse = torch.zeros(rows, vocab)
        coarse[:, ::16] = 1 + torch.rand(rows, (vocab + 15) // 16, generator=g)
        coarse[:, 1:16:2] = 3.0  # 8 logits above every sample
    got = coarse.clone()
    KERNEL.refine(got.data_ptr(), rows, vocab, x.data_ptr(), 0, table.data_ptr(), dim, k)
    exact = (x.double() @ table.double().T).float()
    clean = [r for r in range(rows) if not coarse[r].isnan().any()]
    want = _refined_reference(coarse[clean], exact[clean], k)
    torch.testing.assert_close(got[clean], want, rtol=1e-5, atol=1e-5)
    changed = (got[clean] != coarse[clean]).sum(dim=-1)
    assert bool((changed <= k).all()) and bool((changed >= k - 2).all())


@needs_kernel
@pytest.mark.parametrize("batch", [1, 3])
def test_refine_from_q8_0_blocks_gives_the_float32_tables_bits(batch: int) -> None:
    """`refine` over the file's Q8_0 blocks (q8 = 1) equals `refine` over the float32 table
    they dequantise to, bit for bit; and RefinedHead over either gives the same logits."""
    assert KERNEL is not None
    from neuron_trio.engine.gguf import quant
    from neuron_trio.engine.model.linear import RefinedHead

    g = torch.Generator().manual_seed(11)
    vocab, dim, k = 520, 96, 40
    w = torch.randn(vocab, dim, generator=g).numpy()
    t = gguf.GGMLQuantizationType.Q8_0
    blocks = torch.from_numpy(gguf.quants.quantize(w, t).copy()).reshape(vocab, -1)
    table = quant.dequantize(blocks, quant.QType.Q8_0, (vocab, dim))
    coarse = torch.randn(batch, vocab, generator=g)
    x = torch.randn(batch, dim, generator=g)
    dense, compact = coarse.clone(), coarse.clone()
    KERNEL.refine(dense.data_ptr(), batch, vocab, x.data_ptr(), 0, table.data_ptr(), dim, k)
    KERNEL.refine(compact.data_ptr(), batch, vocab, x.data_ptr(), 0, blocks.data_ptr(), dim, k, 1)
    assert torch.equal(compact, dense)
    assert not torch.equal(dense, coarse)  # it did refine
    head_coarse = Q4Linear(KERNEL, *packing.pack_q4(table), out_dtype=torch.float32)
    by_table = RefinedHead(head_coarse, table, k)
    by_blocks = RefinedHead(head_coarse, blocks, k, q8_dim=dim)
    assert (by_blocks.in_features, by_blocks.out_features) == (dim, vocab)
    assert torch.equal(by_blocks(x), by_table(x))
    many = torch.randn(20, dim, generator=g)  # all logits exact, a slice of blocks at a time
    torch.testing.assert_close(by_blocks(many), many @ table.T, rtol=1e-5, atol=1e-5)
    by_blocks._kernel = None  # torch's topk, gather and bmm over dequantised rows
    torch.testing.assert_close(by_blocks(x), by_table(x), rtol=1e-6, atol=1e-5)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE written out in float64: x · cos + rotate_half(x) · sin (sin unsigned here)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv", "dim"), [(9, 3, 64), (4, 4, 128), (2, 1, 8)])
def test_rope_write_rotates_q_and_k_and_writes_k_v_at_their_rows(
    dtype: torch.dtype, heads: int, kv: int, dim: int
) -> None:
    """Block's native RoPE: Q out, K (rotated) and V (as is) into the pool at each row's token
    row, every other pool row untouched; float32 maths, rounded once to the outputs' dtype."""
    g = torch.Generator().manual_seed(heads * dim)
    n, positions, pool_tokens = 5, 64, 96
    qkv = torch.randn(n, heads + 2 * kv, dim, generator=g)  # float32 in (the kernel's qkv)
    pos = torch.randint(0, positions, (n,), generator=g)
    rows = torch.randperm(pool_tokens, generator=g)[:n]
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * torch.rand(dim // 2).double()
    cos64 = torch.cat((ang.cos(), ang.cos()), dim=-1)
    sin64 = torch.cat((ang.sin(), ang.sin()), dim=-1)
    signed = torch.cat((-ang.sin(), ang.sin()), dim=-1)  # the tables' convention
    cos32, sin32 = cos64.float(), signed.float()
    pool = torch.full((2 * kv, pool_tokens, dim), 7.0, dtype=dtype)
    q = torch.empty(n, heads, dim, dtype=dtype)
    flags = 2 * int(dtype == torch.bfloat16) | 4 * int(dtype == torch.bfloat16)
    KERNEL.rope_write(
        qkv.data_ptr(), n, heads, kv, dim, flags, pos.data_ptr(), cos32.data_ptr(),
        sin32.data_ptr(), pool.data_ptr(), pool_tokens, rows.data_ptr(), q.data_ptr(),
    )  # fmt: skip
    x = qkv.double()
    want = _rotate_half(x[:, : heads + kv], cos64[pos][:, None], sin64[pos][:, None])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q.double(), want[:, :heads], rtol=tol, atol=tol)
    torch.testing.assert_close(
        pool[:kv, rows].double(), want[:, heads:].transpose(0, 1), rtol=tol, atol=tol
    )
    torch.testing.assert_close(
        pool[kv:, rows], x[:, heads + kv :].transpose(0, 1).to(dtype), rtol=0, atol=0
    )
    others = torch.ones(pool_tokens, dtype=torch.bool)
    others[rows] = False
    assert bool((pool[:, others] == 7.0).all())
    # bfloat16 qkv in: the same as its values in float32
    qkv16 = qkv.bfloat16()
    again = torch.empty_like(q)
    KERNEL.rope_write(
        qkv16.data_ptr(), n, heads, kv, dim, flags | 1, pos.data_ptr(), cos32.data_ptr(),
        sin32.data_ptr(), pool.data_ptr(), pool_tokens, rows.data_ptr(), again.data_ptr(),
    )  # fmt: skip
    want16 = _rotate_half(qkv16.double()[:, :heads], cos64[pos][:, None], sin64[pos][:, None])
    torch.testing.assert_close(again.double(), want16, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.slow
def test_the_models_native_rope_is_as_close_to_float32_as_torchs() -> None:
    """The built-in model under "auto" with RoPE and the K/V write in the kernel, against the
    same with torch's RoPE, both against float32: over a prefill and decode steps, on
    scattered blocks (the write's index case) and on consecutive ones (its slice case)."""
    from neuron_trio.engine.gguf.builtin import builtin_model_path
    from neuron_trio.engine.model.load.loader import load_transformer
    from tests.engine.slot_runner import SlotRunner

    path = builtin_model_path()
    native = load_transformer(path, dtype="auto", device="cpu")
    plain = load_transformer(path, dtype="auto", device="cpu")
    assert native.native_kernel is not None
    plain.native_kernel = None
    reference = load_transformer(path, dtype="float32", device="cpu")
    prompt = torch.tensor([[(7 * j + 3) % 49152 for j in range(40)]])
    slot = torch.tensor([1])
    for scattered in (True, False):
        logits = []
        for model in (native, plain, reference):
            runner = SlotRunner(model, slots=2, context=128, scattered=scattered)
            out = runner.forward(prompt, torch.tensor([0]), slot, all_logits=True)[0]
            for i in range(6):  # decode: the same tokens for all three
                token = torch.tensor([[(11 * i + 5) % 49152]])
                out = torch.cat((out, runner.forward(token, torch.tensor([40 + i]), slot)))
            logits.append(out)
        got, torchs, want = logits
        # position 0 has no rotation: the two paths agree exactly there
        assert torch.equal(got[0], torchs[0])
        # a wrong row, position or sign would be far off (errors here: ~0.05 per logit)
        error, torch_error = ((x - want).abs().mean().item() for x in (got, torchs))
        assert error < 1.25 * torch_error, (error, torch_error)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
