"""The block allocator alone: allocation order, sharing, the prefix cache, LRU eviction."""

from __future__ import annotations

import pytest

from neuron_trio.engine.block_pool import (
    BLOCK_TOKENS,
    BOUND_PART,
    RESERVED_BLOCKS,
    BlockPool,
    NoFreeBlockError,
    block_key,
    blocks_for,
    salt_root,
)


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]


def _keys(tokens: list[int]) -> list[bytes]:
    keys: list[bytes] = []
    for i in range(len(tokens) // BLOCK_TOKENS):
        chunk = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        keys.append(block_key(keys[-1] if keys else None, chunk))
    return keys


def test_blocks_go_lowest_first_and_come_back() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 4)
    assert pool.total == 4 and pool.available == 4
    got = [pool.allocate() for _ in range(3)]
    assert got == [2, 3, 4]  # the reserved null and probe blocks are never handed out
    pool.free([3])
    pool.free([2])
    assert pool.allocate() == 2  # the lowest free one, not the last freed
    assert pool.allocate() == 3
    assert pool.allocate() == 5
    stats = pool.statistics()
    assert (stats.used, stats.cached, pool.available) == (4, 0, 0)


def test_exhaustion_raises_and_a_freed_block_serves_again() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 2)
    a, b = pool.allocate(), pool.allocate()
    with pytest.raises(NoFreeBlockError, match="all 2 KV blocks"):
        pool.allocate()
    pool.free([b])
    assert pool.allocate() == b
    assert a != b


def test_a_shared_block_is_free_only_after_its_last_reference() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 2)
    block = pool.allocate()
    pool.share([block])
    pool.share([block])
    pool.free([block])
    pool.free([block])
    assert pool.statistics().used == 1 and pool.available == 1
    pool.free([block])
    assert pool.statistics().used == 0 and pool.available == 2
    with pytest.raises(KeyError):
        pool.free([block])  # a double free is a bug, never silently absorbed


def test_lookup_finds_the_longest_cached_chain_within_the_limit() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 8)
    prompt = _tokens(3 * BLOCK_TOKENS + 5)
    blocks = [pool.allocate() for _ in range(4)]
    for block, key in zip(blocks, _keys(prompt), strict=False):
        pool.register(block, key)  # three full blocks cached; the partial one never is
    pool.free(blocks)
    assert pool.statistics().cached == 3 and pool.statistics().used == 0

    # the same prompt: its three full blocks back (the limit leaves its last token)
    got, keys = pool.lookup(prompt, len(prompt) - 1)
    assert got == blocks[:3] and keys == _keys(prompt)
    assert pool.statistics().used == 3 and pool.statistics().cached == 0
    # a prompt of exactly three blocks: only two (its last token must be computed)
    got2, _ = pool.lookup(prompt[: 3 * BLOCK_TOKENS], 3 * BLOCK_TOKENS - 1)
    assert got2 == blocks[:2]
    # one token changed in the second block: only the first block matches
    other = list(prompt)
    other[BLOCK_TOKENS + 3] += 1
    got3, _ = pool.lookup(other, len(other) - 1)
    assert got3 == blocks[:1]
    # the same tokens after a different first block: nothing (a key names its whole prefix)
    shifted = _tokens(BLOCK_TOKENS, seed=5) + prompt[BLOCK_TOKENS:]
    assert pool.lookup(shifted, len(shifted) - 1) == ([], [])
    stats = pool.statistics()
    hits = (3 + 2 + 1) * BLOCK_TOKENS
    assert (stats.query_tokens, stats.hit_tokens) == (len(prompt) * 3 + 3 * 16 + 0, hits)


def test_unreferenced_cached_blocks_are_evicted_least_recently_used() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 3)
    prompts = [_tokens(BLOCK_TOKENS, seed=s) for s in range(3)]
    blocks = []
    for p in prompts:
        block = pool.allocate()
        pool.register(block, _keys(p)[0])
        blocks.append(block)
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    pool.free([blocks[1]])  # released last: most recently used
    assert pool.available == 3 and pool.statistics().cached == 3
    # a lookup refreshes prompt 0's block: now prompt 2's is the least recently used
    hit, _ = pool.lookup(prompts[0] + [1], BLOCK_TOKENS)
    assert hit == [blocks[0]]
    pool.free(hit)
    assert pool.allocate() == blocks[2]  # evicted: its prefix is forgotten
    assert pool.lookup(prompts[2] + [1], BLOCK_TOKENS) == ([], [])
    assert pool.allocate() == blocks[1]
    assert pool.allocate() == blocks[0]
    with pytest.raises(NoFreeBlockError):
        pool.allocate()
    assert pool.statistics().cached == 0


def test_free_blocks_are_used_before_cached_ones_within_the_bound() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 2 * BOUND_PART)  # a bound of 2 cached blocks
    cached = pool.allocate()
    pool.register(cached, _keys(_tokens(BLOCK_TOKENS))[0])
    pool.free([cached])
    assert pool.allocate() != cached  # a free block first: the cache is kept while it can be


def test_a_miss_on_a_block_the_bound_gave_up_grows_the_bound() -> None:
    pool = _Recorded(RESERVED_BLOCKS + 2 * BOUND_PART)  # a bound of 2 cached blocks
    prompts = [_tokens(BLOCK_TOKENS + 1, seed=s) for s in range(6)]
    for p in prompts[:3]:
        _run(pool, p, None)  # the third prompt's block is the first's, given up
    assert len(pool.written) == 3  # two cached blocks and the partial blocks' one
    hits = pool.statistics().hit_tokens
    _run(pool, prompts[0], None)  # a miss on the given-up block: the bound grows to 3
    assert pool.statistics().hit_tokens == hits
    for p in prompts[3:]:
        _run(pool, p, None)
    for p in prompts[3:]:  # three cached now, all found
        _run(pool, p, None)
    assert pool.statistics().hit_tokens == hits + 3 * BLOCK_TOKENS


def _run(pool: BlockPool, tokens: list[int], tenant: str | None, root: bytes | None = None) -> None:
    """One sequence of `tokens`: its cached prefix looked up, the rest allocated, every full
    block registered, then all released (as the scheduler does)."""
    blocks, keys = pool.lookup(tokens, len(tokens) - 1, root)
    while len(blocks) < blocks_for(len(tokens)):
        blocks.append(pool.allocate(tenant))
    for i in range(len(keys), len(tokens) // BLOCK_TOKENS):
        chunk = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        keys.append(block_key(keys[-1] if keys else root, chunk))
        pool.register(blocks[i], keys[-1])
    pool.free(blocks)


class _Recorded(BlockPool):
    """A pool that records every block it hands out: the pages written."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__(n_blocks)
        self.written: set[int] = set()

    def allocate(self, tenant: str | None = None) -> int:
        block = super().allocate(tenant)
        self.written.add(block)
        return block


def test_one_off_prompts_reuse_their_own_stale_blocks_before_fresh_ones() -> None:
    # 256 blocks, no tenants: 256 / BOUND_PART = 32 cached blocks before its own are reused
    pool = _Recorded(RESERVED_BLOCKS + 256)
    system = _tokens(4 * BLOCK_TOKENS, seed=1)
    for i in range(200):  # a shared system prompt, then a one-off question and answer
        _run(pool, system + _tokens(6 * BLOCK_TOKENS, seed=100 + i), None)
    # the system prompt's 4 blocks, one sequence's 6 and the bound's 32: 42 blocks of
    # the pool written (every one of the 256 without the bound), the prompt still a hit
    assert len(pool.written) <= 4 + 6 + 256 // BOUND_PART
    stats = pool.statistics()
    assert stats.hit_tokens == 199 * 4 * BLOCK_TOKENS


def test_a_tenants_churn_never_evicts_another_tenants_cached_prefix() -> None:
    pool = _Recorded(RESERVED_BLOCKS + 64)
    pool.share_between({"calm": 1.0, "flood": 1.0})  # 32 blocks each, bounds of 4
    calm_root, flood_root = salt_root(b"calm"), salt_root(b"flood")
    system = _tokens(3 * BLOCK_TOKENS, seed=2)
    _run(pool, [*system, 7], "calm", calm_root)
    _run(pool, [*system, 8], "calm", calm_root)  # its system prompt cached, used again
    for i in range(100):  # a flood of one-off prompts, two at once
        other = [pool.allocate("flood") for _ in range(5)]  # a sequence not yet cached
        _run(pool, _tokens(5 * BLOCK_TOKENS, seed=500 + i), "flood", flood_root)
        pool.free(other)
    got, _ = pool.lookup([*system, 9], len(system), calm_root)
    assert len(got) == 3  # calm's prefix is still cached
    # the flood wrote its two sequences' 10 blocks and its bound's 4, nothing more
    assert len(pool.written) <= 3 + 10 + 64 // 2 // BOUND_PART


def test_with_no_block_free_the_tenant_past_its_share_gives_one_up() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 8)
    pool.share_between({"a": 1.0, "b": 3.0})  # shares: 2 and 6 blocks; bounds 1 and 1
    b_prompt, a_prompt = _tokens(BLOCK_TOKENS + 1, seed=1), _tokens(3 * BLOCK_TOKENS + 1)
    _run(pool, b_prompt, "b")  # b's block: the least recently used of all
    _run(pool, a_prompt, "a")  # three blocks cached at once: past a's share of 2
    b_block = pool.lookup(b_prompt, len(b_prompt) - 1)[0]
    a_blocks = pool.lookup(a_prompt, len(a_prompt) - 1)[0]
    pool.free(b_block)
    pool.free(a_blocks)
    held = [pool.allocate("c") for _ in range(4)]  # the blocks never cached
    assert set(held).isdisjoint(a_blocks + b_block)
    # none free, c has no cached block: a is past its share, so a's oldest goes, not b's
    assert pool.allocate("c") == a_blocks[0]
    assert pool.allocate("b") == b_block[0]  # b at its bound: its own
    assert pool.allocate("a") == a_blocks[1]  # a too
    # c has none, a holds 1 of its 2, b none: a's last one
    assert pool.allocate("c") == a_blocks[2]
    with pytest.raises(NoFreeBlockError):
        pool.allocate("b")


def test_a_prefix_registered_twice_keeps_the_first_block() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 3)
    key = _keys(_tokens(BLOCK_TOKENS))[0]
    first, second = pool.allocate(), pool.allocate()
    pool.register(first, key)
    pool.register(second, key)  # computed at the same time by another prompt
    pool.free([first, second])
    assert pool.statistics().cached == 1
    assert pool.lookup([*_tokens(BLOCK_TOKENS), 0], BLOCK_TOKENS)[0] == [first]


def test_without_the_prefix_cache_nothing_is_kept_or_found() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 2, prefix_cache=False)
    prompt = _tokens(BLOCK_TOKENS + 1)
    block = pool.allocate()
    pool.register(block, _keys(prompt)[0])
    pool.free([block])
    assert pool.statistics().cached == 0 and pool.available == 2
    assert pool.lookup(prompt, len(prompt) - 1) == ([], [])
    assert pool.statistics().query_tokens == 0


def test_clear_cache_frees_cached_blocks_and_keeps_blocks_in_use() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 3)
    keys = _keys(_tokens(2 * BLOCK_TOKENS))
    kept, dropped = pool.allocate(), pool.allocate()
    pool.register(kept, keys[0])
    pool.register(dropped, keys[1])
    pool.free([dropped])
    pool.clear_cache()
    assert pool.statistics().cached == 0 and pool.statistics().used == 1
    assert pool.available == 2
    pool.free([kept])  # no longer cached: straight back to the free list
    assert pool.available == 3 and pool.statistics().cached == 0


def test_keys_name_the_tokens_and_everything_before() -> None:
    a = block_key(None, list(range(16)))
    assert a == block_key(None, list(range(16)))
    assert a != block_key(None, [*range(15), 99])
    assert block_key(a, list(range(16))) != a
    assert block_key(a, list(range(16))) != block_key(block_key(None, [1] * 16), list(range(16)))
    assert len(a) == 16  # 128 bits


def test_sizes() -> None:
    assert [blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        BlockPool(RESERVED_BLOCKS)
