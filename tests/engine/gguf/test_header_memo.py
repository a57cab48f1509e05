"""engine/gguf/header_memo.py: a file opened again moments later is not parsed again, unless
its bytes changed; the memo expires and is cleared."""

from __future__ import annotations

import math
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


def count_vocabulary_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from neuron_trio.engine.gguf import checks

    checked: list[str] = []
    real = checks.check_vocabulary

    def counting(path: Path, *args: object, **kwargs: object) -> None:
        checked.append(str(path))
        real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(checks, "check_vocabulary", counting)
    return checked


def stored_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{header_memo.STORE_SUFFIX}"))


def test_a_restart_reads_the_stored_header_instead_of_parsing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is what a restart finds: a process's memo is empty then (cleared here)."""
    header_memo.MEMO.clear()
    header_memo.STORE.use(tmp_path / "headers")
    parses, checked = count_parses(monkeypatch), count_vocabulary_checks(monkeypatch)
    path = write_tiny_llama(tmp_path / "m.gguf", extra_metadata={"general.note": "first"})
    with GGUFFile(path) as first:
        embedding = first.weight("token_embd.weight")
    assert len(stored_files(tmp_path / "headers")) == 1
    header_memo.MEMO.clear()
    with GGUFFile(path) as again:
        assert again.metadata == first.metadata and again.config == first.config
        assert again.tensors == first.tensors and again.data_start == first.data_start
        assert again.weight("token_embd.weight").equal(embedding)
    assert len(parses) == 1 and len(checked) == 1
    # other header bytes at the same size and mtime: parsed and checked again, and stored anew
    stat = path.stat()
    write_tiny_llama(path, extra_metadata={"general.note": "other"})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    header_memo.MEMO.clear()
    with GGUFFile(path) as changed:
        assert changed.metadata["general.note"] == "other"
    assert len(parses) == 2 and len(checked) == 2
    header_memo.MEMO.clear()
    GGUFFile(path).close()
    assert len(parses) == 2


@pytest.mark.parametrize(
    "damage", ["not json", "a list", "no keys", "truncated", "tensors", "digest", "format"]
)
def test_a_damaged_store_entry_means_a_parse_never_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    import json

    header_memo.MEMO.clear()
    header_memo.STORE.use(tmp_path / "headers")
    path = write_tiny_llama(tmp_path / "m.gguf")
    with GGUFFile(path) as first:
        pass
    (entry,) = stored_files(tmp_path / "headers")
    text = entry.read_text()
    data = json.loads(text)
    if damage == "tensors":  # rows that are not what _parse writes
        data["tensors"] = [["token_embd.weight", "Q8_0", [1], 0, 0]]
    elif damage == "digest":
        data["digest"] = "00" * 16
    elif damage == "format":
        data["format"] = header_memo.STORE_FORMAT + 1
    damaged = {"not json": "{{", "a list": "[]", "no keys": '{"format": 1}'}
    damaged["truncated"] = text[: len(text) // 2]
    entry.write_text(damaged.get(damage, json.dumps(data)))
    header_memo.MEMO.clear()
    parses = count_parses(monkeypatch)
    with GGUFFile(path) as again:
        assert again.metadata == first.metadata and again.tensors == first.tensors
    assert len(parses) == 1


def test_the_store_keeps_the_most_recently_used_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(header_memo, "STORE_ENTRIES", 2)
    store = tmp_path / "headers"
    header_memo.STORE.use(store)
    written: list[set[Path]] = []
    for i in range(3):
        header_memo.MEMO.clear()
        before = set(stored_files(store))
        GGUFFile(write_tiny_llama(tmp_path / f"m{i}.gguf")).close()
        (new,) = set(stored_files(store)) - before
        os.utime(new, ns=(i * 10**9, i * 10**9))  # in the order written, whatever the clock
        written.append({new})
    assert set(stored_files(store)) == written[1] | written[2]
    # without a directory nothing is written
    header_memo.STORE.use(None)
    header_memo.MEMO.clear()
    GGUFFile(write_tiny_llama(tmp_path / "m9.gguf")).close()
    assert set(stored_files(store)) == written[1] | written[2]


def test_a_store_that_cannot_be_written_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache directory that became read-only: its entries still spare the parse (marking an
    entry recently used fails quietly), and a new header is parsed without an error."""
    header_memo.MEMO.clear()
    header_memo.STORE.use(tmp_path / "headers")
    path = write_tiny_llama(tmp_path / "m.gguf")
    GGUFFile(path).close()

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(os, "utime", refused)
    monkeypatch.setattr(os, "replace", refused)
    parses = count_parses(monkeypatch)
    header_memo.MEMO.clear()
    GGUFFile(path).close()
    assert parses == []
    header_memo.MEMO.clear()
    GGUFFile(write_tiny_llama(tmp_path / "other.gguf")).close()
    assert len(parses) == 1 and len(stored_files(tmp_path / "headers")) == 1


def test_an_entry_past_the_size_bound_is_neither_written_nor_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header_memo.MEMO.clear()
    header_memo.STORE.use(tmp_path / "headers")
    path = write_tiny_llama(tmp_path / "m.gguf")
    GGUFFile(path).close()
    (entry,) = stored_files(tmp_path / "headers")
    parses = count_parses(monkeypatch)
    monkeypatch.setattr(header_memo, "STORE_MAX_BYTES", entry.stat().st_size - 1)
    header_memo.MEMO.clear()
    GGUFFile(path).close()  # too large to read: parsed
    assert len(parses) == 1
    header_memo.MEMO.clear()
    GGUFFile(write_tiny_llama(tmp_path / "other.gguf")).close()  # too large to write
    assert len(parses) == 2 and stored_files(tmp_path / "headers") == [entry]


def test_a_header_with_a_nan_is_parsed_again_never_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # json writes NaN (not JSON); the store's reader (msgspec) refuses it: a parse, as before
    header_memo.MEMO.clear()
    header_memo.STORE.use(tmp_path / "headers")
    path = write_tiny_llama(tmp_path / "m.gguf", extra_metadata={"general.odd": float("nan")})
    GGUFFile(path).close()
    header_memo.MEMO.clear()
    parses = count_parses(monkeypatch)
    with GGUFFile(path) as again:
        assert math.isnan(again.metadata["general.odd"])
    assert len(parses) == 1


def test_the_store_is_private_like_the_rest_of_the_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries 0600, their directory and the parents it made 0700 (issue 47: files in the
    state directory are the operator's), whatever the umask; an entry and a directory an
    earlier version left 0644 / 0755 are made private when next used."""
    old_umask = os.umask(0o022)
    try:
        header_memo.MEMO.clear()
        store = tmp_path / "cache" / "headers"
        header_memo.STORE.use(store)
        GGUFFile(write_tiny_llama(tmp_path / "m.gguf")).close()
        (entry,) = stored_files(store)
        assert entry.stat().st_mode & 0o777 == 0o600
        assert store.stat().st_mode & 0o777 == 0o700
        assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
        entry.chmod(0o644)
        store.chmod(0o755)
        header_memo.STORE.use(store)
        assert store.stat().st_mode & 0o777 == 0o700
        header_memo.MEMO.clear()
        parses = count_parses(monkeypatch)
        GGUFFile(tmp_path / "m.gguf").close()
        assert parses == [] and entry.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old_umask)
        header_memo.STORE.use(None)
