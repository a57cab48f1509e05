"""Which KV blocks are free, shared or cached: the paged KV cache's bookkeeping, no torch.

The KV cache (`kv_cache.KVCache`) is a pool of blocks of BLOCK_TOKENS positions each; a
sequence holds a block table (its block ids, in position order) that grows as it does. This
module decides which block ids go where:

- Blocks 0 and 1 are reserved: NULL_BLOCK stays zero (gathered padding reads it, so attention
  never sees uninitialised memory) and PROBE_BLOCK is the health probe's scratch row.
- `allocate` hands out the lowest-numbered free block (touched memory stays compact, and a
  sequence alone gets consecutive blocks: a copy-free slice in attention).
- Blocks are refcounted: the n choices of one request share their prompt's full blocks, and
  so do requests whose prompts share a prefix. A block is written only by the one sequence
  that allocated it, before it is full; shared blocks are full, so never written again.
- Prefix cache: a full block is keyed by `block_key(parent's key, its tokens)`, so a key
  names its tokens and everything before them. A request with a cache salt (the client's
  `cache_salt`, the tenant's API key, or both) starts its chain from `salt_root(salt)` instead
  of nothing: its blocks are shared only with requests of the same salt, and another client
  cannot time a hit on them (issue 25, #6). Keys are one-way digests that never reveal the
  salt, and salted chains are never published as KV-cache events (`kv_events.py`: their root
  is never stored, so none of their blocks is). `lookup` finds the longest chain of cached
  blocks for a prompt; a cached block whose last reference goes stays cached ("evictable")
  until `allocate` reuses it (below).
- Which block `allocate` hands out (`_take`): the pool's pages are committed as blocks are
  first written (kv_cache.py), so a never-written block costs resident memory for good, while
  reusing a cached one costs only the prefix it held. Each tenant (the allocating sequence's;
  None without tenants) owns the cached blocks it wrote, least recently used first. Its
  share is the pool times its weight over the configured tenants' (`share_between`; the
  whole pool without tenants), and the blocks it keeps cached before reusing its own
  ("bound") start at `1/BOUND_PART` of that share and grow by one for each block a `lookup`
  misses that the bound made it give up ("ghosts", as in ARC: a workload that comes back to
  its prefixes, a conversation's next turn, earns the pages that would have kept them; one-off
  prompts and answers never come back and earn none), up to the share. So:
  1. a tenant at its bound reuses its own least recently used cached block: its churn of
     one-off prompts recycles its own stale blocks instead of writing fresh pages, and never
     evicts another tenant's cache;
  2. else the lowest-numbered free block;
  3. none free: the oldest block of the tenant furthest past its share, else the allocating
     tenant's own, else that of the tenant holding the most of its share.
  A system prompt that each request shares is used again before it grows old, so it stays.
- Events: with a `KVEventLog` in `events`, evictions and cache resets are recorded there (the
  scheduler records the blocks that become cached), for a KV-aware router (kv_events.py).
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from neuron_trio.engine.kv_events import KVEventLog

BLOCK_TOKENS = 16  # KV positions per block
NULL_BLOCK = 0  # always zero: what padding positions read
PROBE_BLOCK = 1  # the probe's one-token scratch row, never given to a sequence
RESERVED_BLOCKS = 2
# A tenant's cached blocks start bounded by this part of its share of the pool: what a burst
# of one-off prompts may keep (and so commit) before the tenant reuses its own.
BOUND_PART = 8

Owner = str | None  # the tenant that wrote a block (fair_share.Tenant); None: no tenants


def blocks_for(tokens: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // BLOCK_TOKENS)


def block_key(parent: bytes | None, tokens: list[int]) -> bytes:
    """The prefix-cache key of a full block: a 128-bit digest of its parent's key and its tokens.

    A digest rather than Python's `hash`: collisions (two prefixes, one key) would silently
    serve another prompt's K/V, and 64 bits of a non-cryptographic hash are not enough.
    """
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def salt_root(salt: bytes | None) -> bytes | None:
    """The parent of a salted chain's first block (None: no salt, the shared chain).

    A digest personalised apart from `block_key`'s, so that no token sequence of the shared
    chain can produce a salted root.
    """
    if salt is None:
        return None
    return hashlib.blake2b(salt, digest_size=16, person=b"neuron-salt").digest()


class NoFreeBlockError(Exception):
    """Raised by `BlockPool.allocate` if no block is free or evictable."""


@dataclass(frozen=True)
class BlockPoolStatistics:
    total: int  # blocks sequences may use (the reserved ones not counted)
    used: int  # held by at least one sequence
    cached: int  # unreferenced but holding a cached prefix (evictable)
    query_tokens: int  # prompt tokens looked up in the prefix cache
    hit_tokens: int  # ... of which were found (their prefill skipped)


@dataclass
class _Cached:
    """One tenant's unreferenced cached blocks, and what its bound has learnt."""

    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first
    # keys of the blocks the bound gave up (oldest first, at most the tenant's share), and how
    # many of them a lookup has missed since: what its bound has grown by
    ghosts: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    grown: int = 0


class BlockPool:
    """Block ids `RESERVED_BLOCKS .. n_blocks - 1`: refcounts, free list, prefix cache."""

    def __init__(self, n_blocks: int, *, prefix_cache: bool = True) -> None:
        if n_blocks <= RESERVED_BLOCKS:
            raise ValueError(
                f"a KV pool needs more than {RESERVED_BLOCKS} blocks (reserved), got {n_blocks}"
            )
        self.n_blocks = n_blocks
        self.prefix_cache = prefix_cache
        # Invariant: every block id in RESERVED_BLOCKS .. n_blocks - 1 is in exactly one of
        # `_free` (no references, no key), `_refs` (referenced; keyed or not) and one
        # `_cached` list (unreferenced, keyed); `_key_of` and `_block_of` are inverse maps over
        # the keyed blocks, and a keyed block is full (never written again).
        self._free = list(range(RESERVED_BLOCKS, n_blocks))  # a heap: lowest first
        self._refs: dict[int, int] = {}  # block -> references, for blocks in use
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> cached block
        # The evictable blocks by owner (configured tenant names: bounded); `_owner` of every
        # block in use or evictable.
        self._cached: dict[Owner, _Cached] = {}
        self._evictable = 0
        self._owner: dict[int, Owner] = {}
        self._weights: dict[str, float] = {}  # the configured tenants' (`share_between`)
        self._query_tokens = 0
        self._hit_tokens = 0
        # Set from another thread when a router subscribes (attribute writes are atomic).
        self.events: KVEventLog | None = None

    @property
    def total(self) -> int:
        return self.n_blocks - RESERVED_BLOCKS

    @property
    def available(self) -> int:
        """Blocks `allocate` can hand out now: free ones, then evictable cached ones."""
        return len(self._free) + self._evictable

    def statistics(self) -> BlockPoolStatistics:
        return BlockPoolStatistics(
            total=self.total,
            used=len(self._refs),
            cached=self._evictable,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
        )

    def share_between(self, weights: Mapping[str, float]) -> None:
        """The configured tenants' weights (fair_share.py): each tenant's share of the cache
        is the pool times its weight over their sum."""
        self._weights = dict(weights)

    def allocate(self, tenant: Owner = None) -> int:
        """A block for one of `tenant`'s sequences to write (refcount 1); NoFreeBlockError
        if none is left."""
        block = self._take(tenant)
        self._refs[block] = 1
        self._owner[block] = tenant
        return block

    def _share(self, tenant: Owner) -> float:
        """The blocks `tenant`'s cache may hold before it reuses its own (see the top)."""
        weight = self._weights.get(tenant, 1.0) if tenant is not None else 1.0
        total = sum(self._weights.values()) + (0.0 if tenant in self._weights else weight)
        return self.total * weight / total

    def _bound(self, tenant: Owner, cached: _Cached) -> float:
        """How many cached blocks `tenant` keeps before reusing its own (see the top)."""
        share = self._share(tenant)
        return min(share, max(1, share // BOUND_PART) + cached.grown)

    def _take(self, tenant: Owner) -> int:
        own = self._cached.get(tenant)
        if own and len(own.lru) >= self._bound(tenant, own):
            return self._evict(tenant, ghost=True)
        if self._free:
            return heapq.heappop(self._free)
        if not self._evictable:
            raise NoFreeBlockError(f"all {self.total} KV blocks are in use")
        held = {t: len(c.lru) / self._share(t) for t, c in self._cached.items() if c.lru}
        over = max(held, key=held.__getitem__)
        if held[over] <= 1.0 and own and own.lru:
            return self._evict(tenant)
        return self._evict(over)

    def _evict(self, owner: Owner, *, ghost: bool = False) -> int:
        """`owner`'s least recently used cached block, its prefix forgotten; with `ghost`,
        its key kept (a later miss on it grows the owner's bound)."""
        cached = self._cached[owner]
        block, _ = cached.lru.popitem(last=False)
        key = self._key_of.pop(block)
        if ghost:
            cached.ghosts[key] = None
            if len(cached.ghosts) > self._share(owner):
                cached.ghosts.popitem(last=False)
        self._evictable -= 1
        del self._owner[block]
        del self._block_of[key]
        if self.events is not None:
            self.events.removed(key)
        return block

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of `blocks` (all in use)."""
        for block in blocks:
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`; a block no one holds is free again, or
        evictable when it holds a cached prefix."""
        for block in blocks:
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._key_of:
                cached = self._cached.setdefault(self._owner[block], _Cached())
                cached.lru[block] = None  # most recently used: reused last
                self._evictable += 1
            else:
                del self._owner[block]
                heapq.heappush(self._free, block)

    def register(self, block: int, key: bytes) -> bool:
        """`block` (in use, full) holds the prefix `key` names: later prompts may reuse it.
        True if it is newly cached.

        If another block already holds that prefix (two prompts computed it at once), the
        first stays the cached one. Nothing happens with the prefix cache off.
        """
        if not self.prefix_cache or key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def lookup(
        self, tokens: list[int], limit: int, root: bytes | None = None
    ) -> tuple[list[int], list[bytes]]:
        """The longest chain of cached full blocks that starts `tokens` (under `root`, a
        `salt_root`), covering at most `limit` tokens; each block returned has one more
        reference. Also their keys."""
        if not self.prefix_cache:
            return [], []
        blocks: list[int] = []
        keys: list[bytes] = []
        parent: bytes | None = root
        for i in range(min(limit, len(tokens)) // BLOCK_TOKENS):
            key = block_key(parent, tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])
            block = self._block_of.get(key)
            if block is None:
                self._missed(key, tokens[(i + 1) * BLOCK_TOKENS : limit])
                break
            if block in self._refs:
                self._refs[block] += 1
            else:  # unreferenced: out of its owner's list
                del self._cached[self._owner[block]].lru[block]
                self._evictable -= 1
                self._refs[block] = 1
            blocks.append(block)
            keys.append(key)
            parent = key
        self._query_tokens += len(tokens)
        self._hit_tokens += len(blocks) * BLOCK_TOKENS
        return blocks, keys

    def _missed(self, key: bytes, rest: list[int]) -> None:
        """A lookup's chain ends at `key` (then `rest`'s full blocks): each of its blocks a
        tenant's bound gave up would have been a hit with that bound one block larger."""
        owner = next((c for c in self._cached.values() if key in c.ghosts), None)
        for i in range(len(rest) // BLOCK_TOKENS + 1):
            if owner is None or owner.ghosts.pop(key, 0) is not None:
                return
            owner.grown += 1
            key = block_key(key, rest[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])

    def clear_cache(self) -> None:
        """Forget every cached prefix (evictable blocks become free; blocks in use stay)."""
        for cached in self._cached.values():
            for block in cached.lru:
                heapq.heappush(self._free, block)
                del self._owner[block]
        self._cached.clear()  # ghosts and growth too: a reset cache starts over
        self._evictable = 0
        self._key_of.clear()
        self._block_of.clear()
        if self.events is not None:
            self.events.cleared()
