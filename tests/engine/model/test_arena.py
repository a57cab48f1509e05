"""The native kernel's weights gathered into one mapping at the end of a load
(engine/model/arena.py): back to back in the order a decode step reads them, the layers
pointed at the copies, the same logits as where packing left them, and the weight cache
recording the copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_trio.engine.model import arena
from neuron_trio.engine.model.linear import NativeLinear
from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.loader import load_transformer
from neuron_trio.engine.model.load.module_codec import Snapshot
from neuron_trio.engine.model.load.weight_cache import WeightCache
from neuron_trio.engine.model.transformer import Transformer
from tests.engine.slot_runner import SlotRunner
from tests.engine.tiny_families import write_tiny_family

pytestmark = pytest.mark.skipif(
    packing.native_kernel() is None, reason="the native kernel is not built on this machine"
)

# a fused Q/K/V of two kernels (5-bit and int8), an int8 down projection, as Q4_K_M files mix
MIXED = {"attn_v.weight": "Q8_0", "ffn_down.weight": "Q8_0"}


@pytest.fixture(scope="module", params=["Q4_1", "Q5_0"])
def model_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("arena") / f"qwen2-{request.param}.gguf"
    return write_tiny_family(path, "qwen2", qtype=request.param, qtypes=MIXED)


def kernel_buffers(model: Transformer) -> list[tuple[NativeLinear, torch.Tensor]]:
    return [(p, t) for p in arena.decode_order(model) for _, t in p.kernel_tensors()]


def decode_logits(model: Transformer, steps: int = 4) -> torch.Tensor:
    """Logits of a prompt, then of `steps` greedy decode steps (the native loop's path)."""
    runner = SlotRunner(model, slots=1, context=32)
    ids = [1, 5, 9, 2, 7]
    out = [runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]))]
    for i in range(steps):
        token = int(out[-1][0].argmax())
        start = torch.tensor([len(ids) + i])
        out.append(runner.forward(torch.tensor([[token]]), start, torch.tensor([0])))
    return torch.cat(out)


def test_the_kernels_buffers_lie_back_to_back_in_decode_order(model_file: Path) -> None:
    model = load_transformer(model_file, dtype="auto")
    order = arena.decode_order(model)
    layer_parts = [m for m in model.layers.modules() if isinstance(m, NativeLinear)]
    assert order[: len(layer_parts)] == layer_parts and len(order) > len(layer_parts)
    assert order[-1] is model.output.coarse  # the head's coarse pass, read last
    held = kernel_buffers(model)
    storages = {t.untyped_storage().data_ptr() for _, t in held}
    assert len(storages) == 1  # one mapping
    starts = [t.data_ptr() for _, t in held]
    assert starts == sorted(starts)
    ends = [t.data_ptr() + t.numel() * t.element_size() for _, t in held]
    gaps = [b - e for e, b in zip(ends, starts[1:], strict=False)]
    assert all(0 <= g < 64 for g in gaps)  # each on the next cache line
    for projection, _ in held:  # the kernel is called with the copies' addresses
        addresses = {b.data_ptr() for b in projection.buffers()}
        assert set(projection._pointers) <= addresses
        high = projection.__dict__.get("_high", 0)
        assert high == 0 or high in addresses


def test_the_gathered_weights_give_the_same_logits(
    model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gathered = load_transformer(model_file, dtype="auto")
    monkeypatch.setattr(arena, "gather", lambda projections: {})
    scattered = load_transformer(model_file, dtype="auto")
    assert len({t.untyped_storage().data_ptr() for _, t in kernel_buffers(scattered)}) > 1
    assert torch.equal(decode_logits(gathered), decode_logits(scattered))


def test_a_cache_miss_records_the_copies_and_a_hit_is_left_in_its_mapping(
    model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored: list[Snapshot] = []
    real_store = WeightCache.store_logged

    def keeping(self: WeightCache, key: str, snapshot: Snapshot) -> int | None:
        stored.append(snapshot)
        return real_store(self, key, snapshot)

    monkeypatch.setattr(WeightCache, "store_logged", keeping)
    cache = WeightCache(tmp_path / "cache", 1 << 30, background=False)
    built = load_transformer(model_file, dtype="auto", weight_cache=cache)
    (snapshot,) = stored
    mapping = kernel_buffers(built)[0][1].untyped_storage().data_ptr()
    recorded = {t.untyped_storage().data_ptr() for t in snapshot.tensors}
    assert mapping in recorded  # the copies, not the tensors packing made
    copies = {t.data_ptr() for _, t in kernel_buffers(built)}
    assert copies <= {t.data_ptr() for t in snapshot.tensors}

    calls: list[int] = []
    real_gather = arena.gather
    monkeypatch.setattr(arena, "gather", lambda p: calls.append(1) or real_gather(p))
    restored = load_transformer(model_file, dtype="auto", weight_cache=cache)
    assert not calls  # a hit already reads the file's mapping, in this order
    assert torch.equal(decode_logits(restored), decode_logits(built))


def test_a_snapshot_takes_only_copies_of_the_same_dtype_and_shape() -> None:
    a, b = torch.arange(8, dtype=torch.int32), torch.ones(2, 3)
    snap = Snapshot()
    snap.add("a", a)
    snap.add("b", b)
    same, other = a.clone(), torch.zeros(6)
    snap.replace_tensors({a.data_ptr(): same, b.data_ptr(): other})
    assert snap.tensors[0] is same and snap.tensors[1] is b


def test_without_a_mapping_the_weights_stay_and_the_load_goes_on(
    model_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reference = load_transformer(model_file, dtype="auto")

    real_mmap = arena.mmap.mmap

    def refused(fileno: int, *args: Any, **kwargs: Any) -> Any:
        if fileno == -1:  # an anonymous mapping: the arena's (the model file still opens)
            raise OSError(12, "Cannot allocate memory")
        return real_mmap(fileno, *args, **kwargs)

    monkeypatch.setattr(arena.mmap, "mmap", refused)
    with caplog.at_level("WARNING", logger="neuron_trio.engine.model.arena"):
        model = load_transformer(model_file, dtype="auto")
    assert "weights left where packing put them" in caplog.text
    assert len({t.untyped_storage().data_ptr() for _, t in kernel_buffers(model)}) > 1
    assert torch.equal(decode_logits(model), decode_logits(reference))
