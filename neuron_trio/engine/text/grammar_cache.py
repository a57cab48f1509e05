"""The compiled grammars kept for reuse, bounded in entries and in (estimated) bytes.

Issue 25: with 64 entries and no byte bound, ten distinct ~200 KB schemas took the node's RSS
from 870 MB to 7.8 GB. Each entry now carries its estimated memory
(`SchemaSize.estimated_bytes`); the least recently used go until the total fits the budget,
and an entry larger than the whole budget is refused (a 400 naming the bound) rather than
compiled and dropped at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from neuron_trio.errors import RequestError

__all__ = ["CACHE_BYTES", "CACHE_ENTRIES", "GrammarCache", "GrammarCacheStatistics"]

# Distinct constraints kept compiled; least recently used go first.
CACHE_ENTRIES = 64
# The estimated memory of all kept grammars together. At the schema bounds one grammar is
# estimated at ~42 MB at most (measured: 35 MB), so the cache holds at least three of the
# costliest; typical schemas (4-5 MB estimated) fill most of the 64 entries. Measured in one
# process: 20 distinct schemas at the bounds took RSS +200 MB at a 256 MB budget, then flat.
CACHE_BYTES = 128 << 20


@dataclass(frozen=True)
class GrammarCacheStatistics:
    entries: int
    estimated_bytes: int
    evictions: int


class GrammarCache:
    """A thread-safe LRU of compiled grammars by constraint, bounded by `max_entries` and by
    `max_bytes` of estimated memory.

    Invariant: `sum(weights) == self._bytes <= max_bytes` and `len <= max_entries`.
    """

    def __init__(self, *, max_entries: int = CACHE_ENTRIES, max_bytes: int = CACHE_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def admit(self, weight: int, *, param: str) -> None:
        """RequestError (400) naming `param` if an entry of `weight` bytes could never be
        kept: checked before compiling, so what would not fit costs nothing."""
        if weight > self.max_bytes:
            raise RequestError(
                f"{param}: the schema's grammar would take about {weight >> 20} MB, more than "
                f"the grammar cache's {self.max_bytes >> 20} MB (grammar_cache.CACHE_BYTES)",
                param=param,
                code="schema_too_complex",
            )

    def put(self, key: Hashable, value: Any, weight: int) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, weight)
            self._bytes += weight
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
                self._evictions += 1

    def statistics(self) -> GrammarCacheStatistics:
        with self._lock:
            return GrammarCacheStatistics(len(self._entries), self._bytes, self._evictions)
