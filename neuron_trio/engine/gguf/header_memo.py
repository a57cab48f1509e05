"""The parsed header of the GGUF file opened last, reused for a short while.

A model's start opens its file three times (placement's size estimate, the chat-template
probe, the build), and each `GGUFFile` parsed and checked the whole header again: for a
151,936-token vocabulary (303,000 strings with the merges) ~0.4 s each on an idle 2-core
machine, over 1 s on a busy one. A reuse is sound only for the same bytes: an entry holds
the file's identity (path, device, inode, size, mtime) and a digest of its header, and is
used only when both match again; it expires after `MEMO_S` seconds, and holds one file.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

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
