"""The compiled grammars kept for reuse, bounded in entries and in (measured) bytes.

Issue 25: with 64 entries and no byte bound, ten distinct ~200 KB schemas took the node's RSS
from 870 MB to 7.8 GB. Each entry carries its memory; the least recently used go until the
total fits the budget, and an entry larger than the whole budget is refused (a 400 naming the
bound) rather than kept.

Issue 47 (#4): the schema's estimate (`SchemaSize.estimated_bytes`) was all an entry was
charged, and a 122-byte pattern estimated at 4 MB kept ~175 MB: 40 of them took RSS from 3.0
to 6.8 GB. llguidance exposes no size, and its memory grows lazily: the compile allocates
almost nothing, the first mask builds the lexer (175 MB for that pattern), and that memory is
shared by every copy of the cached matcher until the entry goes (measured: freed then). So an
entry is charged the larger of the estimate and what the heap grew by while it was compiled
and its first mask computed (`HeapMeter`: glibc's `mallinfo2`, which follows RSS within a few
percent there: 179 MB against 171 MB). The heap is the process's: another thread's
allocations in that window are charged too (the cache evicts sooner, never later), and memory
freed meanwhile can only lower the measure to the estimate. Later masks add lexer states,
bounded by the compiler's `max_lexer_states`.

What an evicted entry frees goes back to the system (`c_heap.release_freed_heap`, glibc's
`malloc_trim`): llguidance's lexers are freed by the compile threads, whose glibc arenas keep
freed pages mapped, so a churn of large schemas left the node's RSS ~50 MB above what the cache
held (built-in model, five 1,999-key const schemas in one process: RSS 406 -> 569 MB for
101 MB kept; with the trim 519, flat after the second). A trim walks every arena (~0.4 ms
there with nothing to hand back), once per eviction of at least `TRIM_AFTER_BYTES`, on the
compile thread that put the entry, outside the cache's lock.

Keys carry their scope (`Constraint.scope`, the request's prefix-cache salt; a Lark grammar's
key its sequence's cache root): one tenant's compile is never another's hit (issue 47). The
bounds above hold for all scopes together, shared fairly between the tenants that put entries
(`GrammarCache`): a tenant's churn of large schemas recycles its own part of the cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from neuron_trio.engine.c_heap import heap_bytes, release_freed_heap
from neuron_trio.errors import RequestError

__all__ = [
    "CACHE_BYTES",
    "CACHE_ENTRIES",
    "GrammarCache",
    "GrammarCacheStatistics",
    "HeapMeter",
    "heap_bytes",
    "release_freed_heap",
]

# Distinct constraints kept compiled; least recently used go first.
CACHE_ENTRIES = 64
# The estimated memory of all kept grammars together. At the schema bounds one grammar is
# estimated at ~42 MB at most (measured: 35 MB), so the cache holds at least three of the
# costliest; typical schemas (4-5 MB estimated) fill most of the 64 entries. Measured in one
# process: 20 distinct schemas at the bounds took RSS +200 MB at a 256 MB budget, then flat.
CACHE_BYTES = 128 << 20
# Evicted bytes (by their charge) worth handing back to the system at once: a large grammar's.
TRIM_AFTER_BYTES = 8 << 20


class HeapMeter:
    """`with HeapMeter() as meter: ...`, then `meter.grown`: how far the heap grew in the
    block (0 where it cannot be measured, or shrank)."""

    def __init__(self) -> None:
        self.grown = 0
        self._start: int | None = None

    def __enter__(self) -> HeapMeter:
        self._start = heap_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        end = heap_bytes()
        if self._start is not None and end is not None:
            self.grown = max(0, end - self._start)


@dataclass(frozen=True)
class GrammarCacheStatistics:
    entries: int
    estimated_bytes: int
    evictions: int


class GrammarCache:
    """A thread-safe LRU of compiled grammars by constraint, bounded by `max_entries` and by
    `max_bytes` of memory (each entry's measure, or its estimate where larger), shared fairly
    between the tenants that put entries (`owner`: a configured tenant's name, or None).

    Each owner holding entries may keep an equal part of both bounds (its share) before its
    own least recently used entries make room for its new ones; when the cache as a whole is
    full, the owner holding the most bytes gives up its least recently used entry. So one
    tenant's stream of distinct large schemas recycles its own part, never evicts the
    grammars of a tenant within its share, and keeps no more memory than its share (issue
    47: a flood of distinct 1,999-key schemas, ~35 MB each, kept three, most of the 128 MB,
    and evicted the other tenant's). With one owner (no tenants) it is a plain LRU of the
    whole cache.

    Invariant: `sum(weights) == self._bytes <= max_bytes`, `len <= max_entries`, and
    `self._held[o]` is the bytes and entries of owner `o`'s entries (owners with none absent).
    """

    def __init__(self, *, max_entries: int = CACHE_ENTRIES, max_bytes: int = CACHE_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int, str | None]] = OrderedDict()
        self._held: dict[str | None, tuple[int, int]] = {}  # owner -> (bytes, entries)
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

    def admit(self, weight: int, *, param: str, measured: bool = False) -> None:
        """RequestError (400) naming `param` if an entry of `weight` bytes could never be
        kept: checked before compiling with the estimate, so what would not fit costs
        nothing, and after with the measure (the entry is then dropped, not kept)."""
        if weight > self.max_bytes:
            verb = "took" if measured else "would take"
            raise RequestError(
                f"{param}: the schema's grammar {verb} about {weight >> 20} MB, more than "
                f"the grammar cache's {self.max_bytes >> 20} MB (grammar_cache.CACHE_BYTES)",
                param=param,
                code="schema_too_complex",
            )

    def put(self, key: Hashable, value: Any, weight: int, *, owner: str | None = None) -> None:
        evicted = 0
        with self._lock:
            if key in self._entries:
                self._drop(key)
            self._entries[key] = (value, weight, owner)
            self._bytes += weight
            held, count = self._held.get(owner, (0, 0))
            self._held[owner] = (held + weight, count + 1)
            parts = len(self._held)
            while self._over_share(owner, parts) and self._held[owner][1] > 1:
                evicted += self._evict(owner)
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                evicted += self._evict(max(self._held, key=lambda o: self._held[o][0]))
        if evicted >= TRIM_AFTER_BYTES:
            release_freed_heap()  # outside the lock: other compiles need not wait for it

    def _over_share(self, owner: str | None, parts: int) -> bool:
        held, count = self._held[owner]
        return held * parts > self.max_bytes or count * parts > self.max_entries

    def _evict(self, owner: str | None) -> int:
        """Drop `owner`'s least recently used entry; its bytes."""
        self._evictions += 1
        return self._drop(next(k for k, (_, _, o) in self._entries.items() if o == owner))

    def _drop(self, key: Hashable) -> int:
        """Forget `key`'s entry (its value freed here unless a caller holds it); its bytes."""
        _, weight, owner = self._entries.pop(key)
        self._bytes -= weight
        held, count = self._held[owner]
        if count == 1:
            del self._held[owner]
        else:
            self._held[owner] = (held - weight, count - 1)
        return weight

    def statistics(self) -> GrammarCacheStatistics:
        with self._lock:
            return GrammarCacheStatistics(len(self._entries), self._bytes, self._evictions)
