"""What the prefix cache gained and lost, recorded for a KV-aware router (no trio, no I/O).

A router that knows which node holds which prompt prefix can send a conversation back to the
node that has its K/V (llm-d's indexer does, from vLLM's KV-events stream). The block pool
(`block_pool.BlockPool`) and the scheduler record the changes here as they happen; a publisher
in the service layer (`service/kv_events/kv_events_publisher.py`) drains them from its own thread and
sends them on. Recording a block costs about what computing its key already does (one
`stored` call against one `block_key`: 0.8-1.0x in the same run, ~3 µs on a shared 2-core
machine), once per block that becomes cached or leaves the cache: nothing next to the forward
step that filled the block's 16 positions.

Invariant: a block is published only if its parent is published (or it has none), and a block
removal is published only for a block whose storing was. So a consumer never hears of a block
it cannot chain to the start of a prompt, and never of one it was not told about, whatever
was skipped: blocks cached before the log was attached, a tenant's salted blocks (never
published: see `KVEventLog.stored`), or events dropped when the log overflowed.

Bounded: past `capacity` records not yet drained (the publisher stalled), the log drops what
it holds and keeps one "all cleared" in its place, so the consumer forgets this cache rather
than believe a stale picture of it; chains already cached are then not published again (their
parents are no longer published), and the router merely under-estimates this node's cache.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_CAPACITY = 16_384  # records between two drains; ~3 MB at 16 tokens a block


# Records are plain slotted dataclasses, not frozen ones: a frozen one costs 1.5 µs to make
# against 0.6 µs here, once per cached block. Nobody mutates them.
@dataclass(slots=True)
class BlockStoredRecord:
    key: bytes  # the block's prefix-cache key (block_pool.block_key)
    parent: bytes | None  # the key of the block before it; None for a prompt's first block
    tokens: tuple[int, ...]  # the BLOCK_TOKENS token ids the block holds


@dataclass(slots=True)
class BlockRemovedRecord:
    key: bytes


@dataclass(slots=True)
class AllClearedRecord:
    pass


KVEventRecord = BlockStoredRecord | BlockRemovedRecord | AllClearedRecord


@dataclass(frozen=True)
class KVEventLogStatistics:
    recorded: int  # records appended since the log was made
    dropped: int  # records lost to overflows (each overflow published an "all cleared")
    overflows: int
    published_blocks: int  # blocks a consumer has been told are cached (and not removed)


class KVEventLog:
    """A bounded, thread-safe queue of prefix-cache changes: one writer (the engine's thread),
    one reader (`drain`, the publisher's thread)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2:
            raise ValueError(f"a KV event log needs a capacity of at least 2, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._records: list[KVEventRecord] = []
        self._published: set[bytes] = set()  # keys announced as stored and not yet removed
        self._recorded = 0
        self._dropped = 0
        self._overflows = 0

    def stored(self, key: bytes, parent: bytes | None, tokens: Sequence[int]) -> None:
        """A full block became cached under `key`. Skipped (not an error) when its parent was
        never published, so a chain is published from its first block or not at all.

        Salted blocks are never published: a salted chain's first block has the salt's root
        digest as its parent, which is never published, so this rule leaves out the whole
        chain. Publishing them would let a consumer that hashes token ids itself (llm-d's
        indexer) index a tenant's private prefix as a shared one, and send the token ids of
        a private prompt to every subscriber.
        """
        with self._lock:
            if parent is not None and parent not in self._published:
                return
            if key in self._published:
                return
            if self._append(BlockStoredRecord(key, parent, tuple(tokens))):
                self._published.add(key)

    def removed(self, key: bytes) -> None:
        """The block cached under `key` was evicted; recorded only if its storing was."""
        with self._lock:
            if key not in self._published:
                return
            self._published.discard(key)
            self._append(BlockRemovedRecord(key))

    def cleared(self) -> None:
        """Every cached block is gone (the cache was reset, the model recovered or left)."""
        with self._lock:
            self._published.clear()
            self._append(AllClearedRecord())

    def drain(self) -> list[KVEventRecord]:
        """Everything recorded since the last drain, oldest first (the log is then empty)."""
        with self._lock:
            records, self._records = self._records, []
        return records

    def statistics(self) -> KVEventLogStatistics:
        with self._lock:
            return KVEventLogStatistics(
                recorded=self._recorded,
                dropped=self._dropped,
                overflows=self._overflows,
                published_blocks=len(self._published),
            )

    def _append(self, record: KVEventRecord) -> bool:
        """Keep `record`; False if the log was full (then it holds one "all cleared")."""
        # Invariant: called with the lock held.
        self._recorded += 1
        if len(self._records) >= self.capacity:
            self._overflows += 1
            self._dropped += len(self._records) + 1
            self._published.clear()
            self._records = [AllClearedRecord()]
            return False
        self._records.append(record)
        return True
