"""What a loaded model does not hold (issue 49's memory): an untied quantised embedding is
read from the model file a step's rows at a time (embedding.FileEmbedding), the same values;
a native model keeps its float32 RoPE tables only; a tied head reads the embedding's blocks;
no float32 or bfloat16 copy of a packed weight stays beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.embedding import FileEmbedding, FileRows, QuantizedEmbedding
from neuron_trio.engine.model.linear import RefinedHead
from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.loader import load_transformer
from neuron_trio.errors import ModelFileError
from tests.engine.slot_runner import SlotRunner
from tests.engine.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("untied") / "m.gguf", qtype="Q4_1", tied=False)


def test_an_untied_quantised_embedding_stays_in_the_file(untied: Path) -> None:
    model = load_transformer(untied, dtype="auto", device="cpu")
    assert isinstance(model.embedding, FileEmbedding)
    with GGUFFile(untied) as gf:
        info = gf.tensors["token_embd.weight"]
        table = quant.dequantize(
            gf.raw("token_embd.weight"), quant.QType(info.qtype), (info.shape[0], info.shape[1])
        )
        row_bytes = info.nbytes // info.shape[0]
    # no buffer of the model holds the table's blocks
    held = [n for n, b in model.named_buffers() if b.shape[-1:] == (row_bytes,)]
    assert held == []
    ids = torch.tensor([5, 0, 5, info.shape[0] - 1, 3])
    assert torch.equal(model.embedding(ids), table[ids])


def _file(tmp_path: Path) -> tuple[Path, bytes]:
    data = bytes(range(256)) * 4  # 64 rows of 16 bytes after a 0-byte header
    path = tmp_path / "rows.bin"
    path.write_bytes(data)
    return path, data


def test_file_rows_read_what_was_asked(tmp_path: Path) -> None:
    path, data = _file(tmp_path)
    rows = FileRows(path, 16, 63, 16)
    got = rows.take(torch.tensor([[2, 0], [2, 62]]))
    want = [data[16 + r * 16 : 32 + r * 16] for r in (2, 0, 2, 62)]
    assert [bytes(row.tolist()) for row in got] == want
    with pytest.raises(IndexError):
        rows.take(torch.tensor([63]))
    with pytest.raises(ModelFileError, match="pass its end"):
        FileRows(path, 32, 63, 16)


def test_a_file_replaced_by_a_rename_is_still_the_one_read(tmp_path: Path) -> None:
    path, data = _file(tmp_path)
    rows = FileRows(path, 0, 64, 16)
    other = tmp_path / "new.bin"
    other.write_bytes(b"\xff" * len(data))
    os.replace(other, path)
    assert bytes(rows.take(torch.tensor([1]))[0].tolist()) == data[16:32]


@pytest.mark.parametrize("change", ["cut short", "rewritten"])
def test_a_file_changed_in_place_is_refused(tmp_path: Path, change: str) -> None:
    path, _ = _file(tmp_path)
    rows = FileRows(path, 0, 64, 16)
    with open(path, "r+b") as f:
        if change == "cut short":
            f.truncate(100)
        else:
            f.write(b"\x00" * 16)
    os.utime(path, ns=(1, 1))  # a rewrite within the same clock tick still moves mtime
    with pytest.raises(ModelFileError, match="changed on disk"):
        rows.take(torch.tensor([0]))


@pytest.mark.skipif(packing.native_kernel() is None, reason="the native kernel is not built")
def test_a_native_model_keeps_one_rope_table_and_builds_torchs_when_asked(untied: Path) -> None:
    model = load_transformer(untied, dtype="auto", device="cpu")
    assert model.native_kernel is not None and model.rope_f32[0].shape[0] > 0
    assert model.rope_cos.is_meta and model.rope_sin.is_meta  # no second copy in bfloat16
    prompt = torch.tensor([[1, 5, 3, 7, 2]])
    native = SlotRunner(model, slots=1, context=32).forward(
        prompt, torch.tensor([0]), torch.tensor([0])
    )
    model._native_rope = lambda kv: False  # type: ignore[method-assign]  # torch's RoPE
    plain = SlotRunner(model, slots=1, context=32).forward(
        prompt, torch.tensor([0]), torch.tensor([0])
    )
    assert model.rope_cos.shape[0] >= prompt.shape[1] and model.rope_cos.dtype == model.act_dtype
    assert (native.argmax(-1) == plain.argmax(-1)).all()
    assert torch.allclose(native, plain, atol=0.1, rtol=0.02)


@pytest.mark.skipif(packing.native_kernel() is None, reason="the native kernel is not built")
def test_a_tied_head_reads_the_embeddings_blocks_kept_once(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tied.gguf", qtype="Q4_1", tied=True)
    model = load_transformer(path, dtype="auto", device="cpu")
    assert isinstance(model.embedding, QuantizedEmbedding) and isinstance(model.output, RefinedHead)
    rows = model.embedding.rows.untyped_storage()
    assert model.output.table.untyped_storage().data_ptr() == rows.data_ptr()


@pytest.mark.parametrize("tied", [True, False])
def test_no_dense_copy_of_a_packed_weight_is_kept(tmp_path: Path, tied: bool) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", qtype="Q4_1", tied=tied, ffn_dim=96)
    model = load_transformer(path, dtype="auto", device="cpu")
    c = model.config
    packed = {(c.vocab_size, c.dim), (c.ffn_dim, c.dim), (c.dim, c.ffn_dim), (c.dim, c.dim)}
    dense = (torch.float32, torch.bfloat16, torch.float16)
    kept = [
        (name, tuple(buf.shape))
        for name, buf in model.named_buffers()
        if buf.dtype in dense and not buf.is_meta and tuple(buf.shape[-2:]) in packed
    ]
    assert kept == []


def test_a_head_in_another_block_format_refines_from_its_blocks_exactly(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", qtype="Q4_1", tied=False)
    model = load_transformer(path, dtype="auto", device="cpu")
    head = model.output
    assert isinstance(head, RefinedHead) and head.table.dtype == torch.uint8
    assert quant.QType(head.qtype) == quant.QType.Q4_1
    with GGUFFile(path) as gf:
        info = gf.tensors["output.weight"]
        table = quant.dequantize(gf.raw("output.weight"), quant.QType.Q4_1, info.shape)
    dense = RefinedHead(head.coarse, table, head.refine)  # the float32 table it used to keep
    x = torch.randn(3, model.config.dim, generator=torch.Generator().manual_seed(0))
    # the same values; torch's bmm (blocks) and the kernel's refine (float32) sum in their
    # own orders
    assert torch.allclose(head(x), dense(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(head(x).argmax(-1), dense(x).argmax(-1))
