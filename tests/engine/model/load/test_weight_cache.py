"""The packed-weight cache (engine/model/load/weight_cache.py, module_codec.py, cached_load.py) and
the quantised embedding: a hit restores the very model a miss built, without dequantising;
a damaged file costs only the cache; the directory stays bounded; the key follows the file."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.embedding import FileEmbedding, QuantizedEmbedding
from neuron_trio.engine.model.linear import (
    Int4Linear,
    Int8Linear,
    Linear,
    Q4Linear,
    Q8Linear,
    RefinedHead,
    StackedLinear,
)
from neuron_trio.engine.model.load import loader, module_codec, packing
from neuron_trio.engine.model.load.load_phases import LoadPhases
from neuron_trio.engine.model.load.loader import load_transformer
from neuron_trio.engine.model.load.module_codec import (
    Snapshot,
    SnapshotError,
    UncacheableError,
    decode,
)
from neuron_trio.engine.model.load.sizing import estimate_weight_bytes
from neuron_trio.engine.model.load.weight_cache import WeightCache, snapshot_key
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


@needs_int
@pytest.mark.skipif(packing.native_kernel() is None, reason="no native kernel on this build")
def test_a_cache_entry_is_for_one_prefill_copies_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NEURON_DENSE_COPIES decides what a packed layer holds: a start with the other setting
    packs afresh instead of restoring the copies it turned off (or lacking those it asked for)."""
    path = write_tiny_llama(tmp_path / "m.gguf", **SHAPE, qtype="Q4_0")
    cache = WeightCache(tmp_path / "cache", BIG, background=False)
    monkeypatch.setenv("NEURON_DENSE_COPIES", "1")
    _, phases = load(path, cache)
    assert "weight cache miss: stored" in phases.summary()
    monkeypatch.setenv("NEURON_DENSE_COPIES", "0")
    model, phases = load(path, cache)
    assert "weight cache miss" in phases.summary()
    assert not [n for n in buffers(model) if n.endswith(".dense")]


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


needs_kernel = pytest.mark.skipif(packing.native_kernel() is None, reason="no native kernel here")


def layers_of_every_class() -> dict[str, nn.Module]:
    """One small layer of each class the cache may hold (the native ones where the kernel is
    here), built as the loader builds them."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=gen)
    layers: dict[str, nn.Module] = {"Linear": Linear(w.clone())}
    if packing.int4_available():
        packed, scales_zeros = packing.pack_int4(w)
        layers["Int4Linear"] = Int4Linear(packed, scales_zeros, 16, 64, packing.INT4_GROUP)
        layers["Int8Linear"] = Int8Linear(*packing.pack_int8(w))
    kernel = packing.native_kernel()
    if kernel is not None:
        nibbles, scale, minimum = packing.pack_q4(w)
        q4 = Q4Linear(kernel, nibbles, scale, minimum, w.bfloat16(), out_dtype=torch.float32)
        layers["Q4Linear"] = q4
        q8 = Q8Linear(kernel, *packing.pack_q8(w), keep_dtype=True)
        layers["Q8Linear"] = q8
        layers["StackedLinear"] = StackedLinear([q4, q8])
        coarse = Q4Linear(kernel, *packing.pack_q4_symmetric(w), None, coarse=True)
        layers["RefinedHead"] = RefinedHead(coarse, w.clone(), 4)
    rows = torch.randint(0, 256, (16, quant.raw_nbytes(quant.QType.Q8_0, 64)), dtype=torch.uint8)
    rows.view(-1, 34)[:, :2] = torch.full((rows.numel() // 34, 1), 0.01).half().view(torch.uint8)
    layers["QuantizedEmbedding"] = QuantizedEmbedding(rows, quant.QType.Q8_0, 64)
    return layers


def test_each_cacheable_class_is_rebuilt_by_its_own_constructor() -> None:
    layers = layers_of_every_class()
    snap = Snapshot()
    for name, layer in layers.items():
        snap.add(name, layer)
    copies = [t.clone() for t in snap.tensors]  # restored elsewhere, as a read file is
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    for name, layer in layers.items():
        node = snap.slots[name]
        assert isinstance(node, module_codec.ModuleNode) and node.cls == name
        # plain fields only: no address among them
        assert all(not isinstance(v, int) or abs(v) < 1 << 20 for v in node.fields.values())
        restored = decode(node, copies)
        assert type(restored) is type(layer), name
        arg = {"QuantizedEmbedding": torch.tensor([0, 15, 3]), "Int4Linear": x.bfloat16()}.get(
            name, x.bfloat16() if name == "Int8Linear" else x
        )
        assert torch.equal(restored(arg), layer(arg)), name
        stored = {t.data_ptr() for t in copies}
        for module in restored.modules():  # a native layer took its own tensors' addresses
            for pointer in module.__dict__.get("_pointers", ()):
                assert pointer in stored and pointer in {b.data_ptr() for b in module.buffers()}


def test_a_snapshot_names_only_its_own_classes() -> None:
    with pytest.raises(UncacheableError, match=r"class torch\.nn\.modules\.linear\.Linear"):
        Snapshot().add("h", nn.Linear(4, 4).requires_grad_(False))
    snap = Snapshot()
    snap.add("e", layers_of_every_class()["QuantizedEmbedding"])
    node = snap.slots["e"]
    assert isinstance(node, module_codec.ModuleNode)
    node.cls = "os.system"
    with pytest.raises(SnapshotError, match="not one a snapshot may name"):
        decode(node, snap.tensors)
    node.cls = "QuantizedEmbedding"
    node.tensors["rows"] = 7
    with pytest.raises(SnapshotError, match="tensor 7 of 1"):
        decode(node, snap.tensors)


@needs_kernel
@pytest.mark.parametrize(
    ("cls", "tensor", "bad"),
    [
        (
            "Q4Linear",
            "scale",
            lambda t: t[:-1].contiguous(),
        ),  # a tile short: the kernel would read past it
        ("Q4Linear", "nibbles", lambda t: t.view(torch.int8)),
        ("Q8Linear", "group_sums", lambda t: t.reshape(-1)),
        ("RefinedHead", "table", lambda t: t[:8].contiguous()),
    ],
)
def test_tensors_that_do_not_fit_their_class_are_refused_before_any_kernel_reads_them(
    cls: str, tensor: str, bad: Any
) -> None:
    snap = Snapshot()
    snap.add("layer", layers_of_every_class()[cls])
    node = snap.slots["layer"]
    assert isinstance(node, module_codec.ModuleNode)
    copies = list(snap.tensors)
    copies[node.tensors[tensor]] = bad(copies[node.tensors[tensor]])  # type: ignore[index]
    with pytest.raises(SnapshotError):
        decode(node, copies)


def test_views_of_one_storage_and_parameters_are_not_cached() -> None:
    base = torch.zeros(8)
    with pytest.raises(UncacheableError, match="views"):
        snap = Snapshot()
        snap.add("a", base[:4])
        snap.add("b", base[4:])
    with pytest.raises(UncacheableError, match="parameter"):
        Snapshot().add("p", nn.Parameter(torch.zeros(2)))


def two_region_snapshot() -> Snapshot:
    snap = Snapshot()
    snap.add("a", torch.arange(64, dtype=torch.uint8))
    snap.add("b", torch.arange(64, 128, dtype=torch.uint8))
    return snap


def test_two_swapped_regions_are_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = WeightCache(tmp_path, BIG, background=False)
    size = cache.store("k", two_region_snapshot())
    assert size is not None and cache.load("k") is not None
    data = bytearray(cache.path("k").read_bytes())
    start = size - 128  # the two 64-byte tensors, back to back at the end
    data[start : start + 64], data[start + 64 : size] = (
        data[start + 64 : size],
        data[start : start + 64],
    )
    cache.path("k").write_bytes(bytes(data))  # the same bytes, the same word sum: moved
    with caplog.at_level(logging.WARNING):
        assert cache.load("k") is None
    assert "checksum mismatch" in caplog.text and not cache.path("k").exists()


def test_cache_files_are_the_users_alone(tmp_path: Path) -> None:
    shared = tmp_path / "state"
    shared.mkdir(mode=0o755)
    cache = WeightCache(shared / "cache" / "weights", BIG, background=False)
    cache.store("k", two_region_snapshot())
    assert stat.S_IMODE(cache.path("k").stat().st_mode) == 0o600
    for directory in (shared / "cache", shared / "cache" / "weights"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    existing = WeightCache(shared, BIG, background=False)
    existing.store("k", two_region_snapshot())
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700


TRUNCATED_WHILE_IN_USE = """
import sys, torch
from pathlib import Path
from tests.engine.model.load.test_weight_cache import load, logits
from neuron_trio.engine.model.load.weight_cache import WeightCache

model_file, directory = Path(sys.argv[1]), Path(sys.argv[2])
cache = WeightCache(directory, 1 << 30, background=False)
load(model_file, cache)  # a miss: stored
model, phases = load(model_file, cache)
assert "weight cache hit" in phases.summary(), phases.summary()
(entry,) = directory.glob("*.nwc")
with open(entry, "r+b") as f:
    f.truncate(0)  # as a full disk's cleanup, or an operator, might
for ids in ([1, 2, 3], [7, 7, 7, 7]):
    logits(model, ids)  # reads every restored layer
print("served after the truncation")
"""


@needs_int
def test_a_cache_file_truncated_while_in_use_does_not_kill_the_node(tmp_path: Path) -> None:
    model_file = write_tiny_llama(tmp_path / "m.gguf", **SHAPE, qtype="Q4_0")
    root = Path(__file__).resolve().parents[4]
    done = subprocess.run(
        [sys.executable, "-c", TRUNCATED_WHILE_IN_USE, str(model_file), str(tmp_path / "c")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # A mapped file cut short: the first read of a lost page was SIGBUS (exit -7 / 135).
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "served after the truncation" in done.stdout


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
    assert isinstance(model.embedding, FileEmbedding)  # read from the file: nothing held
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
    phases.note("weight cache hit: 1.00 GB read")
    stats = phases.statistics()
    assert [n for n, _ in stats.seconds] == ["parse", "dequantize", "pack"]
    assert stats.seconds[0][1] == 0.75
    assert phases.summary().startswith("1.75 s: parse 0.75, dequantize 1.00, pack 0.00;")
    assert phases.summary().endswith("; weight cache hit: 1.00 GB read")
    assert loader.load_transformer  # the loader's public name stays
