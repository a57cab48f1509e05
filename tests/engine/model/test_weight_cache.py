"""The packed-weight cache (engine/model/weight_cache.py, module_codec.py, cached_load.py) and
the quantised embedding: a hit restores the very model a miss built, without dequantising;
a damaged file costs only the cache; the directory stays bounded; the key follows the file."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model import loader, module_codec, packing
from neuron_trio.engine.model.embedding import QuantizedEmbedding
from neuron_trio.engine.model.load_phases import LoadPhases
from neuron_trio.engine.model.loader import load_transformer
from neuron_trio.engine.model.module_codec import (
    Snapshot,
    SnapshotError,
    UncacheableError,
    decode,
)
from neuron_trio.engine.model.sizing import estimate_weight_bytes
from neuron_trio.engine.model.weight_cache import WeightCache, snapshot_key
from tests.engine.model.weight_reads import record_weight_reads
from tests.engine.slot_runner import SlotRunner
from tests.engine.tiny_gguf import write_tiny_llama

SHAPE: dict[str, Any] = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
BIG = 1 << 30

needs_int = pytest.mark.skipif(
    not packing.int4_available(), reason="no int kernels on this build (auto is float32)"
)


@pytest.fixture(scope="module", params=["tied-Q4_1", "untied-Q4_0", "untied-Q5_0"])
def model_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tied, qtype = request.param.split("-")
    path = tmp_path_factory.mktemp("wc") / f"{request.param}.gguf"
    return write_tiny_llama(path, **SHAPE, qtype=qtype, tied=tied == "tied")


def logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    runner = SlotRunner(model, slots=1, context=32)  # type: ignore[arg-type]
    return runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]))


def load(path: Path, cache: WeightCache | None) -> tuple[nn.Module, LoadPhases]:
    phases = LoadPhases()
    return load_transformer(path, dtype="auto", weight_cache=cache, phases=phases), phases


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if not n.startswith("rope")}


@needs_int
def test_a_hit_restores_the_model_a_miss_built(
    model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = WeightCache(tmp_path / "cache", BIG, background=False)
    reference, _ = load(model_file, None)
    built, phases = load(model_file, cache)
    assert "weight cache miss: stored" in phases.summary()
    assert len(list((tmp_path / "cache").glob("*.nwc"))) == 1
    dequantised = record_weight_reads(monkeypatch)
    restored, phases = load(model_file, cache)
    assert "weight cache hit" in phases.summary()
    # only norms and biases come from the file on a hit: no projection, no table
    assert dequantised and all(n.endswith("norm.weight") for n in dequantised)
    want, got_built, got = buffers(reference), buffers(built), buffers(restored)
    assert want.keys() == got.keys() == got_built.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name
    ids = [1, 5, 9, 2, 7, 3]
    assert torch.equal(logits(restored, ids), logits(reference, ids))
    # the restored layers call the kernel with their own tensors' addresses
    for module in restored.modules():
        pointers = module.__dict__.get("_pointers")
        if pointers is not None:
            assert all(p >= 1 << 32 for p in pointers)
            addresses = {b.data_ptr() for b in module.buffers()}
            assert set(pointers) <= addresses


@needs_int
@pytest.mark.parametrize("damage", ["flip a data byte", "truncate", "garbage header", "empty"])
def test_a_damaged_file_is_logged_removed_and_repacked(
    model_file: Path, tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = WeightCache(tmp_path, BIG, background=False)
    reference, _ = load(model_file, cache)
    (entry,) = tmp_path.glob("*.nwc")
    data = bytearray(entry.read_bytes())
    if damage == "flip a data byte":
        data[-100] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage header":
        data[20:40] = os.urandom(20)
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        model, phases = load(model_file, cache)
    assert "is unusable" in caplog.text and "weight cache miss: stored" in phases.summary()
    ids = [4, 4, 8, 1]
    assert torch.equal(logits(model, ids), logits(reference, ids))
    assert "weight cache hit" in load(model_file, cache)[1].summary()  # stored afresh


@needs_int
def test_the_key_follows_the_file_and_the_scheme(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", **SHAPE, qtype="Q4_0")

    def key(scheme: str = "cpu-int", options: str = "") -> str:
        with GGUFFile(path) as gf:
            return snapshot_key(gf, scheme, torch.device("cpu"), options)

    first = key()
    assert key() == first
    assert key("float32") != first and key(options="refine=8") != first
    os.utime(path, ns=(1, 1))  # the same bytes, touched
    touched = key()
    assert touched != first
    write_tiny_llama(path, **SHAPE, qtype="Q4_0", seed=1)  # same size, other weights
    os.utime(path, ns=(1, 1))
    assert key() != touched


def snapshot_of(nbytes: int) -> Snapshot:
    snap = Snapshot()
    snap.add("t", torch.ones(nbytes, dtype=torch.uint8))
    return snap


def test_the_least_recently_used_entries_are_evicted(tmp_path: Path) -> None:
    entry = 4096 + 1024  # a page of header, then the data (to a multiple of 64 bytes)
    cache = WeightCache(tmp_path, 3 * entry + 1000, background=False)
    sizes = {key: cache.store(key, snapshot_of(1000)) for key in ("a", "b", "c")}
    assert all(size == entry for size in sizes.values())
    for age, key in enumerate(("b", "a", "c")):  # b is the oldest, then a
        os.utime(cache.path(key), (1000 + age, 1000 + age))
    assert cache.store("d", snapshot_of(1000)) == entry
    assert sorted(p.stem for p in tmp_path.glob("*.nwc")) == ["a", "c", "d"]
    assert cache.load("a") is not None  # a hit counts as a use
    os.utime(cache.path("c"), (1, 1))
    cache.store("e", snapshot_of(1000))
    assert sorted(p.stem for p in tmp_path.glob("*.nwc")) == ["a", "d", "e"]
    # an entry larger than the whole cache is not written, and evicts nothing
    assert cache.store("huge", snapshot_of(3 * entry)) is None
    assert len(list(tmp_path.glob("*.nwc"))) == 3
    # a dead writer's temporary file goes at the next eviction; a live one's stays
    dead, live = tmp_path / ".x.999999999.ab.tmp", tmp_path / f".y.{os.getpid()}.cd.tmp"
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    cache.evict()
    assert not dead.exists() and live.exists()


class Holder(nn.Module):
    """A module as the loader's layers are: buffers, a child, plain settings, a pointer."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("absent", None)
        self.child = nn.Identity()
        self.pointer = weight.data_ptr()
        self.settings = (3, 0.5, "x", None, torch.bfloat16, [True])


def test_a_snapshot_restores_classes_buffers_and_pointers(monkeypatch: pytest.MonkeyPatch) -> None:
    holder = Holder(torch.arange(6.0))
    with pytest.raises(UncacheableError, match="class tests"):
        Snapshot().add("h", holder)  # only the project's classes (and torch's) are named
    monkeypatch.setattr(module_codec, "_ALLOWED_MODULE_PREFIXES", ("tests.", "torch.nn."))
    snap = Snapshot()
    snap.add("h", holder)
    snap.add("same", holder.weight)  # shared: stored once
    assert len(snap.tensors) == 1
    copies = [t.clone() for t in snap.tensors]
    restored = decode(snap.slots["h"], copies)
    assert type(restored) is Holder and restored.weight is copies[0]
    assert restored.absent is None and decode(snap.slots["same"], copies) is copies[0]
    assert restored.pointer == copies[0].data_ptr() != holder.pointer
    assert restored.settings == holder.settings and isinstance(restored.child, nn.Identity)
    spec = snap.slots["h"][1]
    spec["cls"] = "os:system"
    with pytest.raises(SnapshotError, match="not one a snapshot may name"):
        decode(snap.slots["h"], copies)


def test_pointers_below_4_gib_are_re_pointed_and_checked_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A small tensor can live on the C heap of a non-PIE interpreter, below 4 GiB: whether an
    # int is a pointer must not depend on its size (as if every address were small here).
    monkeypatch.setattr(module_codec, "_POINTER_MIN", 1 << 62)
    monkeypatch.setattr(module_codec, "_ALLOWED_MODULE_PREFIXES", ("tests.", "torch.nn."))
    holder = Holder(torch.arange(6.0))
    snap = Snapshot()
    snap.add("h", holder)
    copies = [t.clone() for t in snap.tensors]
    restored = decode(snap.slots["h"], copies)
    assert restored.pointer == copies[0].data_ptr() != holder.pointer
    holder.__dict__["pointer"] = holder.weight.data_ptr() + 8  # inside it, not its start
    with pytest.raises(UncacheableError, match="inside a tensor"):
        Snapshot().add("h", holder)


def test_what_a_snapshot_cannot_restore_safely_is_refused() -> None:
    holder = nn.Module()
    holder.register_buffer("w", torch.zeros(4))
    holder.__dict__["address"] = holder.w.data_ptr() + 4  # inside a tensor, not its start
    with pytest.raises(UncacheableError, match="address"):
        Snapshot().add("h", holder)
    holder.__dict__["address"] = lambda: 0
    with pytest.raises(UncacheableError, match="function"):
        Snapshot().add("h", holder)
    table = nn.Module()
    weights = torch.zeros(4)
    table.register_buffer("w", weights)
    table.register_buffer("pointers", torch.tensor([weights.data_ptr()]))
    snap = Snapshot()
    snap.add("t", table)
    with pytest.raises(UncacheableError, match="int64 tensor"):
        snap.check_pointers()
    base = torch.zeros(8)
    views = nn.Module()
    views.register_buffer("a", base[:4])
    views.register_buffer("b", base[4:])
    with pytest.raises(UncacheableError, match="views"):
        Snapshot().add("v", views)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"])
def test_quantised_embedding_rows_equal_the_float32_table(qtype: str) -> None:
    kind = quant.QType[qtype]
    block, size = quant.BLOCK_SIZES[kind]
    vocab, dim = 37, 2 * max(block, 64)
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (vocab, dim // block, size), dtype=torch.uint8, generator=gen)
    # small finite float16 scales (random bytes could be NaN or infinite)
    scale = torch.full((vocab, dim // block), 0.01, dtype=torch.float16).view(torch.uint8)
    offsets = {"Q6_K": [208], "Q4_K": [0, 2]}.get(qtype, [0])
    for at in offsets:
        raw[:, :, at : at + 2] = scale.reshape(vocab, dim // block, 2)
    rows = raw.reshape(vocab, -1)
    table = quant.dequantize(rows, kind, (vocab, dim))
    ids = torch.tensor([0, 36, 5, 5, 17])
    got = QuantizedEmbedding(rows, kind, dim)(ids)
    assert got.dtype == torch.float32 and torch.equal(got, table[ids])


@needs_int
def test_an_untied_models_embedding_stays_quantised_and_is_counted(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "u.gguf", **SHAPE, qtype="Q4_0", tied=False)
    model = load_transformer(path, dtype="auto")
    assert isinstance(model.embedding, QuantizedEmbedding)
    assert model.tok_embeddings.numel() == 0
    reference = load_transformer(path, dtype="float32")
    ids = [3, 1, 4, 1, 5]
    want = torch.nn.functional.embedding(torch.tensor(ids), reference.tok_embeddings)
    assert torch.equal(model.embedding(torch.tensor(ids)), want)
    seen: set[int] = set()
    held = 0
    for name, buf in model.named_buffers():
        if not name.startswith("rope_") and buf.untyped_storage().data_ptr() not in seen:
            seen.add(buf.untyped_storage().data_ptr())
            held += buf.untyped_storage().nbytes()
    with GGUFFile(path) as gf:
        estimate = estimate_weight_bytes(gf, "auto", "cpu")
    assert 0.9 * held <= estimate <= 1.1 * held


def test_phases_add_up_in_order_with_notes() -> None:
    phases = LoadPhases()
    phases.add("parse", 0.5)
    phases.add("dequantize", 1.0)
    phases.add("parse", 0.25)
    with phases.phase("pack"):
        pass
    phases.note("weight cache hit: 1.00 GB mapped")
    stats = phases.statistics()
    assert [n for n, _ in stats.seconds] == ["parse", "dequantize", "pack"]
    assert stats.seconds[0][1] == 0.75
    assert phases.summary().startswith("1.75 s: parse 0.75, dequantize 1.00, pack 0.00;")
    assert phases.summary().endswith("; weight cache hit: 1.00 GB mapped")
    assert loader.load_transformer  # the loader's public name stays
