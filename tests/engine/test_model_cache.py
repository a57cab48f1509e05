"""The model cache: a second load reads the first one's packed weights, with the same outputs;
anything that changes them changes the key; a bad or foreign file is never used."""

from __future__ import annotations

import os
import pathlib
import shutil
import threading
from pathlib import Path

import pytest
import torch

from neuron_trio.engine import model_cache
from neuron_trio.engine.engine import Engine
from neuron_trio.engine.gguf_file import GGUFFile
from neuron_trio.engine.model import Transformer
from neuron_trio.engine.types import SamplingParams
from tests.engine.tiny_gguf import write_tiny_llama

CPU = torch.device("cpu")


@pytest.fixture
def tiny_q4(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "q4.gguf", qtype="Q4_1", seed=7)


def _load(path: Path, cache: Path, dtype: str = "auto") -> Transformer:
    with GGUFFile(path) as gguf:
        return model_cache.load_transformer_cached(
            gguf, dtype=dtype, device=CPU, cache_dir=cache, background=False
        )


def _logits(model: Transformer) -> torch.Tensor:
    from neuron_trio.engine.loader import SingleRunner

    runner = SingleRunner(model, blocks=3, context=32)  # block 2: the first after reserved
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    return runner.forward(ids, torch.zeros(1, dtype=torch.int64), torch.tensor([[2]]))


def _forbid_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> Transformer:
        raise AssertionError("loaded from the GGUF file, not the cache")

    monkeypatch.setattr(model_cache, "load_transformer", refuse)


def test_a_second_load_reads_the_cache_and_computes_the_same(
    tiny_q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first = _load(tiny_q4, cache)
    assert len(list(cache.glob("*.pt"))) == 1
    _forbid_loading(monkeypatch)
    second = _load(tiny_q4, cache)
    assert second.scheme == first.scheme == "cpu-int"
    assert torch.equal(_logits(first), _logits(second))


def test_the_key_follows_the_file_the_dtype_and_the_engine_sources(
    tiny_q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = model_cache.cache_key(tiny_q4, "auto", CPU)
    assert model_cache.cache_key(tiny_q4, "auto", CPU) == key
    assert model_cache.cache_key(tiny_q4, "float32", CPU) != key
    stat = tiny_q4.stat()
    os.utime(tiny_q4, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert model_cache.cache_key(tiny_q4, "auto", CPU) != key  # the file was replaced
    key = model_cache.cache_key(tiny_q4, "auto", CPU)
    monkeypatch.setattr(model_cache, "_engine_digest", lambda: "another engine")
    assert model_cache.cache_key(tiny_q4, "auto", CPU) != key  # a changed loader or model


def test_a_corrupt_entry_is_removed_and_the_file_loaded(tiny_q4: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    entry = cache / (model_cache.cache_key(tiny_q4, "auto", CPU) + model_cache.SUFFIX)
    cache.mkdir()
    entry.write_bytes(b"not a torch file")
    model = _load(tiny_q4, cache)
    assert isinstance(model, Transformer)
    assert model_cache.load_cached(entry) is not None  # rewritten by that load


def test_an_entry_naming_a_foreign_class_is_never_unpickled(tmp_path: Path) -> None:
    entry = tmp_path / "x.pt"
    torch.save({"path": pathlib.PurePosixPath("/etc/passwd")}, entry)
    assert model_cache.load_cached(entry) is None
    assert not entry.exists()


def test_an_entry_holding_something_else_than_a_model_is_dropped(tmp_path: Path) -> None:
    entry = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2)}, entry)
    assert model_cache.load_cached(entry) is None
    assert not entry.exists()


def test_prune_keeps_the_most_recently_used(tmp_path: Path) -> None:
    for i in range(6):
        entry = tmp_path / f"{i}.pt"
        entry.write_bytes(b"x")
        os.utime(entry, (1000 + i, 1000 + i))
    leftover = tmp_path / ".5.pt.123.tmp"
    leftover.write_bytes(b"half written")
    os.utime(leftover, (1000, 1000))
    model_cache.prune(tmp_path, keep=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2.pt", "3.pt", "4.pt", "5.pt"]


def test_an_engine_from_the_cache_generates_the_same_text(tiny_q4: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    texts = []
    for _ in range(2):  # the first loads and writes, the second reads
        engine = Engine.from_gguf(tiny_q4, dtype="auto", device=CPU, context=64, cache_dir=cache)
        engine.add([1, 5, 9, 13], params, chat=False)
        out = []
        while engine.has_work:
            out += [t for e in engine.step() for t in e.token_ids]
        texts.append(out)
        for thread in threading.enumerate():  # the background write
            if thread.name == "neuron-model-cache":
                thread.join()
    assert texts[0] == texts[1] and len(texts[0]) == 8
    assert len(list(cache.glob("*.pt"))) == 1


def test_no_entry_is_written_that_would_fill_the_disk(
    tiny_q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    with GGUFFile(tiny_q4) as gguf:
        model = model_cache.load_transformer_cached(
            gguf, dtype="auto", device=CPU, cache_dir=tmp_path / "unused", background=False
        )
    size = model_cache.model_bytes(model)
    assert size > 0
    monkeypatch.setattr(model_cache, "MIN_FREE_BYTES", shutil.disk_usage(tmp_path).free - size // 2)
    assert not model_cache.store(cache / "x.pt", model)
    assert list(cache.glob("*")) == []
    monkeypatch.setattr(model_cache, "MIN_FREE_BYTES", 0)
    assert model_cache.store(cache / "x.pt", model)
