"""Hostile GGUF files: every lie in the header is a ModelFileError naming it, cheaply.

Each file is under 1 MB and written byte by byte (tests/engine/hostile_gguf.py). The bound on
memory is measured with tracemalloc (numpy's buffers are traced too): before the checks, the
3,000,000-block file alone allocated over 2 GB building tensor names.
"""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import pytest

from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.errors import ModelFileError
from tests.engine.hostile_gguf import (
    T_ARRAY,
    T_STRING,
    T_UINT32,
    enc_string,
    kv,
    kv_str,
    kv_u32,
    llama_kvs,
    llama_tensors,
    raw_gguf,
)

MAX_PEAK_BYTES = 50 << 20


def _refused(path: Path, match: str) -> str:
    """Open `path`: it must fail with ModelFileError matching `match`, within the memory bound."""
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError, match=match) as info:
            GGUFFile(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_PEAK_BYTES, f"peak {peak / 1e6:.1f} MB"
    return str(info.value)


def test_a_well_formed_tiny_llama_loads(tmp_path: Path) -> None:
    # The control: the same writer, no lie, is a model.
    path = raw_gguf(tmp_path / "ok.gguf", llama_kvs(), llama_tensors())
    with GGUFFile(path) as f:
        assert (f.config.n_layers, f.config.n_heads, f.config.head_dim) == (1, 2, 4)


def test_huge_block_count_is_refused_before_names_are_built(tmp_path: Path) -> None:
    path = raw_gguf(tmp_path / "blocks.gguf", llama_kvs(blocks=3_000_000), llama_tensors())
    message = _refused(path, "block_count")
    assert "3000000" in message


def test_block_count_beyond_the_tensor_table(tmp_path: Path) -> None:
    path = raw_gguf(tmp_path / "blocks.gguf", llama_kvs(blocks=50), llama_tensors())
    _refused(path, r"block_count = 50 but the file holds 11 tensors")


def test_counts_larger_than_the_file(tmp_path: Path) -> None:
    _refused(raw_gguf(tmp_path / "kv.gguf", llama_kvs(), n_kv=1 << 40), "cannot fit")
    _refused(raw_gguf(tmp_path / "t.gguf", llama_kvs(), n_tensors=1 << 50), "cannot fit")


def test_array_longer_than_the_file(tmp_path: Path) -> None:
    strings = kv("tokenizer.ggml.tokens", T_ARRAY, struct.pack("<IQ", T_STRING, 1 << 40))
    _refused(raw_gguf(tmp_path / "a.gguf", [strings]), "elements")
    ints = kv("tokenizer.ggml.token_type", T_ARRAY, struct.pack("<IQ", T_UINT32, 1 << 30))
    _refused(raw_gguf(tmp_path / "b.gguf", [ints]), "elements")


def test_a_string_longer_than_the_file(tmp_path: Path) -> None:
    lie = struct.pack("<Q", 1 << 60) + b"x" * 64
    _refused(raw_gguf(tmp_path / "s.gguf", [lie]), "truncated")


def test_deeply_nested_arrays_are_refused_not_a_recursion_error(tmp_path: Path) -> None:
    depth = 3000
    payload = struct.pack("<IQ", T_ARRAY, 1) * depth + struct.pack("<IQ", T_UINT32, 0)
    _refused(raw_gguf(tmp_path / "deep.gguf", [kv("x.nested", T_ARRAY, payload)]), "nested")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("heads", 0),
        ("kv_heads", 0),
        ("dim", 0),
        ("ffn", 0),
        ("dim", 1 << 30),
    ],
)
def test_shape_numbers_out_of_range(tmp_path: Path, key: str, value: int) -> None:
    shape = {"dim": 8, "heads": 2, "kv_heads": 1, "ffn": 16} | {key: value}
    kvs = llama_kvs(
        dim=shape["dim"], heads=shape["heads"], kv_heads=shape["kv_heads"], ffn=shape["ffn"]
    )
    path = raw_gguf(tmp_path / "zero.gguf", kvs, llama_tensors())
    _refused(path, "is not an integer from 1 to")


def test_a_zero_alignment(tmp_path: Path) -> None:
    kvs = [*llama_kvs(), kv_u32("general.alignment", 0)]
    _refused(raw_gguf(tmp_path / "align.gguf", kvs, llama_tensors()), "general.alignment")


def test_rope_base_must_be_positive(tmp_path: Path) -> None:
    path = raw_gguf(
        tmp_path / "rope.gguf", llama_kvs(extra={"llama.rope.freq_base": -1.0}), llama_tensors()
    )
    _refused(path, "rope.freq_base")


def test_tensor_shapes_must_match_the_metadata(tmp_path: Path) -> None:
    tensors = llama_tensors()
    tensors[3] = ("blk.0.attn_q.weight", (12, 8))  # 3 heads' worth of rows, metadata says 2
    _refused(raw_gguf(tmp_path / "shape.gguf", llama_kvs(), tensors), r"attn_q.weight has shape")


def test_tensor_with_impossible_dims(tmp_path: Path) -> None:
    tensors = [("token_embd.weight", (0, 8)), *llama_tensors()[1:]]
    _refused(raw_gguf(tmp_path / "dims.gguf", llama_kvs(), tensors), "impossible shape")


def test_tensor_listed_twice(tmp_path: Path) -> None:
    tensors = [*llama_tensors(), ("output_norm.weight", (8,))]
    _refused(raw_gguf(tmp_path / "twice.gguf", llama_kvs(), tensors), "listed twice")


def test_tensor_data_past_the_end(tmp_path: Path) -> None:
    path = raw_gguf(tmp_path / "short.gguf", llama_kvs(), llama_tensors())
    path.write_bytes(path.read_bytes()[:-64])
    _refused(path, "past the end")


def test_empty_and_garbage_files(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    _refused(tmp_path / "empty.gguf", "not a GGUF file")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\xff" * 5)
    _refused(tmp_path / "junk.gguf", "truncated")
    (tmp_path / "str.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + enc_string("k"))
    _refused(tmp_path / "str.gguf", "cannot fit|truncated")


def test_unknown_value_type(tmp_path: Path) -> None:
    path = raw_gguf(
        tmp_path / "type.gguf", [kv_str("general.architecture", "llama"), kv("x", 99, b"")]
    )
    _refused(path, "unknown GGUF value type 99")
