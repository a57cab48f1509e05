"""engine/gguf/header_memo.py: a file opened again moments later is not parsed again, unless
its bytes changed; the memo expires and is cleared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neuron_trio.engine.gguf import header_memo
from neuron_trio.engine.gguf.file import GGUFFile
from tests.engine.tiny_gguf import write_tiny_llama


def count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    parses: list[str] = []
    real = GGUFFile._parse

    def counting(self: GGUFFile) -> None:
        parses.append(str(self.path))
        real(self)

    monkeypatch.setattr(GGUFFile, "_parse", counting)
    return parses


def test_a_file_reopened_is_not_parsed_again_unless_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header_memo.MEMO.clear()
    parses = count_parses(monkeypatch)
    path = write_tiny_llama(tmp_path / "m.gguf", extra_metadata={"general.note": "first"})
    with GGUFFile(path) as first:
        note = first.metadata["general.note"]
    with GGUFFile(path) as again:
        assert again.metadata == first.metadata and again.config == first.config
        assert again.tensors == first.tensors and again.data_start == first.data_start
    assert note == "first" and len(parses) == 1
    # the same size and the same mtime, other header bytes: parsed again
    stat = path.stat()
    write_tiny_llama(path, extra_metadata={"general.note": "other"})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    with GGUFFile(path) as changed:
        assert changed.metadata["general.note"] == "other"
    assert len(parses) == 2
    # another path to the same file is its own entry (errors name the path they were given)
    link = tmp_path / "link.gguf"
    link.symlink_to(path)
    GGUFFile(link).close()
    assert len(parses) == 3


def test_the_memo_expires_and_clears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    header_memo.MEMO.clear()
    parses = count_parses(monkeypatch)
    path = write_tiny_llama(tmp_path / "m.gguf")
    GGUFFile(path).close()
    monkeypatch.setattr(header_memo, "MEMO_S", -1.0)
    GGUFFile(path).close()
    assert len(parses) == 2
    monkeypatch.setattr(header_memo, "MEMO_S", 60.0)
    GGUFFile(path).close()
    header_memo.MEMO.clear()
    GGUFFile(path).close()
    assert len(parses) == 3
