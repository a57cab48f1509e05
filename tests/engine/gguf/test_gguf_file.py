"""GGUF reading: metadata, config, every supported block format, Q/K un-permutation, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.gguf.file import GGUFFile, permute_qk, unpermute_qk
from neuron_trio.engine.model.load import packing
from neuron_trio.errors import ModelLoadError, UnsupportedModelError
from tests.engine.tiny_gguf import (
    BOS_ID,
    CHATML_TEMPLATE,
    EOS_ID,
    tiny_vocab,
    tiny_weights,
    write_tiny_llama,
)

SHAPE: dict[str, Any] = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf", **SHAPE)


def logical_weights() -> dict[str, np.ndarray]:
    tokens, _, _ = tiny_vocab()
    return tiny_weights(**SHAPE, vocab_size=len(tokens), tied=True, seed=0)


def test_metadata_and_config(tiny_f32: Path) -> None:
    with GGUFFile(tiny_f32) as gf:
        md = gf.metadata
        c = gf.config
    tokens, types, merges = tiny_vocab()
    assert md["general.architecture"] == "llama"
    assert md["tokenizer.ggml.tokens"] == tokens
    assert md["tokenizer.ggml.token_type"] == types
    assert md["tokenizer.ggml.merges"] == merges
    assert md["tokenizer.ggml.bos_token_id"] == BOS_ID
    assert md["tokenizer.ggml.eos_token_id"] == EOS_ID
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert md["tokenizer.chat_template"] == CHATML_TEMPLATE
    assert isinstance(md["llama.rope.freq_base"], float)
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert (c.ffn_dim, c.vocab_size, c.context_length) == (128, len(tokens), 256)
    assert c.rope_base == 10000.0 and c.rope_dim == 16 and c.tied_output
    assert c.rms_eps == pytest.approx(1e-5)


def test_tensor_names_and_logical_weights(tiny_f32: Path) -> None:
    expected = logical_weights()
    with GGUFFile(tiny_f32) as gf:
        assert set(gf.tensor_names) == set(expected)
        for name, w in expected.items():
            got = gf.weight(name)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, torch.from_numpy(w), rtol=0, atol=0, msg=name)
        # As stored, Q is permuted (llama.cpp's layout), so it differs from the logical one.
        assert not torch.equal(
            gf.dequantize("blk.0.attn_q.weight"), gf.weight("blk.0.attn_q.weight")
        )


def test_unpermute_inverts_permute() -> None:
    w = torch.randn(6 * 16, 40)
    torch.testing.assert_close(unpermute_qk(permute_qk(w, 6), 6), w, rtol=0, atol=0)
    # Logical row (head 0, half 1, i) sits at stored row 2i + 1.
    stored = permute_qk(w, 6)
    torch.testing.assert_close(stored[1], w[8], rtol=0, atol=0)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_written_formats_match_gguf_round_trip(tmp_path: Path, qtype: str) -> None:
    path = write_tiny_llama(tmp_path / f"{qtype}.gguf", **SHAPE, qtype=qtype)
    expected = logical_weights()
    t = gguf.GGMLQuantizationType[qtype]
    with GGUFFile(path) as gf:
        for name in ("blk.1.ffn_down.weight", "blk.0.attn_v.weight", "blk.1.attn_k.weight"):
            assert gf.tensors[name].qtype == int(t)
            w = torch.from_numpy(expected[name])
            is_k = name.endswith("attn_k.weight")
            stored = permute_qk(w, SHAPE["n_kv_heads"]) if is_k else w
            ref = gguf.quants.dequantize(gguf.quants.quantize(stored.numpy(), t), t)
            ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
            torch.testing.assert_close(gf.dequantize(name), ref_t, rtol=0, atol=0, msg=name)
            logical = unpermute_qk(ref_t, SHAPE["n_kv_heads"]) if is_k else ref_t
            torch.testing.assert_close(gf.weight(name), logical, rtol=0, atol=0, msg=name)


def _random_blocks(qtype: quant.QType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for `n_blocks` blocks, with every float16 field a sane finite scale."""
    _, size = quant.BLOCK_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    f16_fields = {
        quant.QType.Q8_0: [0],
        quant.QType.Q4_0: [0],
        quant.QType.Q4_1: [0, 2],
        quant.QType.Q4_K: [0, 2],
        quant.QType.Q5_K: [0, 2],
        quant.QType.Q6_K: [208],
        quant.QType.Q5_0: [0],
        quant.QType.Q5_1: [0, 2],
        quant.QType.IQ4_NL: [0],
        quant.QType.IQ4_XS: [0],
        quant.QType.Q2_K: [80, 82],
        quant.QType.Q3_K: [108],
    }[qtype]
    for off in f16_fields:
        scales = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize(
    "name",
    ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL",
     "IQ4_XS"],
)  # fmt: skip
def test_block_formats_match_gguf_reference(name: str) -> None:
    qtype = quant.QType[name]
    block, _ = quant.BLOCK_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    rows, cols = 6, 2 * max(block, 256)
    blocks = _random_blocks(qtype, rows * cols // block, rng)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name]).reshape(rows, cols)
    got = quant.dequantize(torch.from_numpy(blocks), qtype, (rows, cols))
    torch.testing.assert_close(got, torch.from_numpy(ref.astype(np.float32)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_float_formats(name: str) -> None:
    w = torch.randn(4, 64)
    dt = torch.float16 if name == "F16" else torch.bfloat16
    raw = w.to(dt).contiguous().view(torch.uint8)
    got = quant.dequantize(raw, quant.QType[name], (4, 64))
    torch.testing.assert_close(got, w.to(dt).float(), rtol=0, atol=0)


def test_int4_packing_reproduces_q4_1_blocks() -> None:
    """Requantising a Q4_1 weight to int4 groups of 32 keeps its grid (up to bf16 scales)."""
    w = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    t = gguf.GGMLQuantizationType.Q4_1
    deq = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, t), t).copy())
    packed, sz = packing.pack_int4(deq)
    x = torch.randn(3, 128)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz).float()
    ref = x @ deq.T
    assert (y - ref).abs().max() < 0.05 * ref.abs().max()


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", **SHAPE, arch="mamba")
    with pytest.raises(UnsupportedModelError, match="mamba"):
        GGUFFile(path)


def test_unsupported_tensor_type_names_tensor(tmp_path: Path) -> None:
    path = write_tiny_llama(
        tmp_path / "mxfp4.gguf", **SHAPE, overrides={"blk.1.ffn_up.weight": "MXFP4"}
    )
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_up\.weight.*MXFP4"):
        GGUFFile(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        GGUFFile(bad)
    with pytest.raises(ModelLoadError, match="cannot open"):
        GGUFFile(tmp_path / "missing.gguf")


@pytest.mark.parametrize(
    ("name", "kind"),
    [("Q5_0", "Q4Linear"), ("Q5_1", "Q4Linear"), ("Q5_K", "Q4Linear"), ("IQ4_NL", "Q8Linear"),
     ("Q2_K", "Q8Linear"), ("Q3_K", "Q8Linear"), ("IQ4_XS", "Q8Linear"), ("Q6_K", "Q8Linear")],
)  # fmt: skip
def test_auto_on_cpu_keeps_new_formats_quantised(
    tmp_path: Path, name: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dtype = "auto"` on CPU (loader.packing_kind): the native kernel keeps Q5_0, Q5_1 and
    Q5_K as their own 5-bit codes; formats it has no layer for at their width (IQ4's grid,
    Q2_K and Q3_K's scales per 16 weights, Q6_K) take its wider int8 layer; without the
    kernel, all of them torch's int8 kernel. The layer's dense copy (kept for prefill: here
    asked for) equals the file's float32 dequantisation (to bfloat16)."""
    from neuron_trio.engine.model.load.loader import load_transformer

    monkeypatch.setenv("NEURON_DENSE_COPIES", "1")

    shape = {**SHAPE, "dim": 256, "ffn_dim": 256}  # K-quants need rows of 256
    qtype = quant.QType[name]
    block, _ = quant.BLOCK_SIZES[qtype]
    blocks = _random_blocks(qtype, 256 * 256 // block, np.random.default_rng(0))
    path = write_tiny_llama(
        tmp_path / f"{name}.gguf",
        **shape,
        raw_blocks={"blk.0.ffn_down.weight": (name, blocks.reshape(256, -1))},
    )
    if not packing.int4_available():
        pytest.skip("this torch has no CPU int4 kernel")
    model = load_transformer(path, dtype="auto", device="cpu")
    layer = model.layers[0].w_down
    if packing.native_kernel() is None:
        kind = "Int8Linear"
    assert type(layer).__name__ == kind
    with GGUFFile(path) as gf:
        want = gf.weight("blk.0.ffn_down.weight")
    torch.testing.assert_close(layer.dense.float(), want.to(torch.bfloat16).float())
