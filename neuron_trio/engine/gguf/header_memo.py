"""The parsed header of the GGUF file opened last, reused for a short while.

A model's start opens its file three times (placement's size estimate, the chat-template
probe, the build), and each `GGUFFile` parsed and checked the whole header again: for a
151,936-token vocabulary (303,000 strings with the merges) ~0.4 s each on an idle 2-core
machine, over 1 s on a busy one. A reuse is sound only for the same bytes: an entry holds
the file's identity (path, device, inode, size, mtime) and a digest of its header, and is
used only when both match again; it expires after `MEMO_S` seconds, and holds one file.

`STORE` keeps parsed headers on disk between the daemon's starts, under the same rule: a
restart reads its models' headers back instead of parsing and checking them again. Its files
are 0600 in 0700 directories, as the packed weights beside them: a header names the model and
holds its chat template, the operator's to show.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from neuron_trio.engine.gguf.checks import MAX_HEADER_BYTES

MEMO_S = 120.0


@dataclass(frozen=True)
class ParsedHeader:
    """What `GGUFFile` derives from its header: metadata, tensor table, data offset, config."""

    metadata: dict[str, Any]
    tensors: dict[str, Any]
    data_start: int
    config: Any


def file_identity(path: str, fd: int) -> tuple[Any, ...]:
    stat = os.fstat(fd)
    return (path, stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def header_digest(data: Any, data_start: int) -> bytes:
    return hashlib.blake2b(data[:data_start], digest_size=16).digest()


class HeaderMemo:
    """One parsed header, its file's identity and header digest, and when it was stored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[tuple[Any, ...], bytes, float, ParsedHeader] | None = None

    def lookup(self, identity: tuple[Any, ...], data: Any) -> ParsedHeader | None:
        """The header stored for `identity` if its bytes are still those of `data` (the
        mapped file) and it is younger than MEMO_S; else None."""
        with self._lock:
            entry = self._entry
        if entry is None or entry[0] != identity or time.monotonic() - entry[2] > MEMO_S:
            return None
        parsed = entry[3]
        if len(data) < parsed.data_start or header_digest(data, parsed.data_start) != entry[1]:
            return None
        return parsed

    def store(self, identity: tuple[Any, ...], data: Any, parsed: ParsedHeader) -> None:
        digest = header_digest(data, parsed.data_start)
        with self._lock:
            self._entry = (identity, digest, time.monotonic(), parsed)

    def clear(self) -> None:
        """Drop the entry (its vocabulary is tens of MB of Python objects)."""
        with self._lock:
            self._entry = None


MEMO = HeaderMemo()


# ---- on disk, between starts -------------------------------------------------------------

STORE_FORMAT = 1
STORE_SUFFIX = ".gguf-header.json"
STORE_ENTRIES = 8  # headers kept (the most recently used); a few MB each
# An entry's bytes at most: twice the largest header a GGUF file may have (JSON adds quotes
# and separators). A larger file is not read, a larger entry not written: that start parses,
# as any other.
STORE_MAX_BYTES = 2 * MAX_HEADER_BYTES
_FILE_MODE, _DIR_MODE = 0o600, 0o700  # the state directory's modes (weight_cache.py's too)


def _private_dir(path: str) -> None:
    """Create `path` and any missing parent as 0700; an existing `path` is made 0700 too
    (one an earlier version made 0755)."""
    missing = []
    at = path
    while at and not os.path.exists(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, _DIR_MODE)
    with contextlib.suppress(OSError):  # not ours to change: left as it is
        os.chmod(path, _DIR_MODE)


class HeaderStore:
    """Parsed headers kept on disk between the daemon's starts, in a directory the service
    names (`use`; none: nothing is kept). A restart then reads a model's header back (~0.1 s
    for Qwen2.5's 151,936-token vocabulary) instead of parsing and checking it again (~0.6 s
    on an AMD EPYC 7003 core). The same rule as `HeaderMemo`: an entry is used only for the
    same file identity and the same header bytes (its digest). JSON, not pickle: a file in
    the state directory is read as data, never run.

    `load` gives (metadata, tensor rows `[name, qtype, shape, offset, nbytes]`, data_start);
    it and `save` never raise: a store that cannot be read or written is a parse like any
    other start's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._directory: str | None = None

    def use(self, directory: str | os.PathLike[str] | None) -> None:
        with self._lock:
            self._directory = None if directory is None else os.fspath(directory)
        if directory is not None and os.path.isdir(directory):
            with contextlib.suppress(OSError):  # one an earlier version made 0755
                os.chmod(directory, _DIR_MODE)

    def _path(self, identity: tuple[Any, ...]) -> str | None:
        with self._lock:
            directory = self._directory
        if directory is None:
            return None
        name = hashlib.blake2b(repr(identity).encode(), digest_size=16).hexdigest()
        return os.path.join(directory, name + STORE_SUFFIX)

    def load(
        self, identity: tuple[Any, ...], data: Any
    ) -> tuple[dict[str, Any], list[list[Any]], int] | None:
        path = self._path(identity)
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_size > STORE_MAX_BYTES:
                    return None
                if stat.st_mode & 0o077:  # an entry an earlier version wrote 0644
                    with contextlib.suppress(OSError):
                        os.fchmod(f.fileno(), _FILE_MODE)
                # msgspec's decoder: Gemma 3's 6.9 MB entry in ~0.06 s, json's ~0.13 (a
                # header with a NaN, which json writes and msgspec refuses, is parsed again)
                entry = msgspec.json.decode(f.read())
            data_start = entry["data_start"]
            if (
                entry["format"] != STORE_FORMAT
                or entry["identity"] != list(identity)
                or not isinstance(data_start, int)
                or not 0 < data_start <= len(data)
                or header_digest(data, data_start).hex() != entry["digest"]
            ):
                return None
            metadata, tensors = entry["metadata"], entry["tensors"]
            if not isinstance(metadata, dict) or not isinstance(tensors, list):
                return None
        except (OSError, ValueError, KeyError, TypeError, msgspec.DecodeError):
            return None
        with contextlib.suppress(OSError):  # a read-only cache still serves its entries
            os.utime(path)  # recently used: kept by `save`'s pruning
        return metadata, tensors, data_start

    def save(
        self,
        identity: tuple[Any, ...],
        data: Any,
        metadata: dict[str, Any],
        tensors: list[list[Any]],
        data_start: int,
    ) -> None:
        path = self._path(identity)
        if path is None:
            return
        entry = {
            "format": STORE_FORMAT,
            "identity": list(identity),
            "digest": header_digest(data, data_start).hex(),
            "data_start": data_start,
            "metadata": metadata,
            "tensors": tensors,
        }
        temporary = f"{path}.{os.getpid()}.tmp"
        try:
            encoded = json.dumps(entry, ensure_ascii=False).encode("utf-8")
            if len(encoded) > STORE_MAX_BYTES:
                return
            _private_dir(os.path.dirname(path))
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
            with os.fdopen(fd, "wb") as f:
                f.write(encoded)
            os.replace(temporary, path)
            self._prune(os.path.dirname(path))
        except (OSError, ValueError, TypeError):
            with contextlib.suppress(OSError):
                os.unlink(temporary)

    @staticmethod
    def _prune(directory: str) -> None:
        entries = []
        for name in os.listdir(directory):
            if name.endswith(STORE_SUFFIX):
                with contextlib.suppress(OSError):
                    full = os.path.join(directory, name)
                    entries.append((os.stat(full).st_mtime_ns, full))
        for _, full in sorted(entries, reverse=True)[STORE_ENTRIES:]:
            with contextlib.suppress(OSError):
                os.unlink(full)


STORE = HeaderStore()
