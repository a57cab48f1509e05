"""The prefix cache's event log: what the block pool and the scheduler record, and what not."""

from __future__ import annotations

import threading

import pytest

from neuron_trio.engine.block_pool import BLOCK_TOKENS, RESERVED_BLOCKS, BlockPool, block_key
from neuron_trio.engine.kv_events import (
    AllClearedRecord,
    BlockRemovedRecord,
    BlockStoredRecord,
    KVEventLog,
)
from neuron_trio.engine.types import SamplingParams
from tests.engine.drain import drain as _run
from tests.engine.fake_runner import fake_engine, prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def _chain(tokens: list[int], parent: bytes | None = None) -> list[tuple[bytes, bytes | None]]:
    """(key, parent key) of each full block of `tokens`."""
    out: list[tuple[bytes, bytes | None]] = []
    for i in range(len(tokens) // BLOCK_TOKENS):
        key = block_key(parent, tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])
        out.append((key, parent))
        parent = key
    return out


def test_engine_records_each_newly_cached_block_with_its_parent_and_tokens() -> None:
    engine, _ = fake_engine(max_batch=2, context=64, prefill_chunk=64)
    log = KVEventLog()
    engine.record_kv_events(log)
    prompt = prompt_ids(40)  # two full blocks and 8 tokens
    engine.add(prompt, GREEDY, chat=False)
    _run(engine)
    stored = log.drain()
    chain = _chain(prompt)
    assert stored == [
        BlockStoredRecord(key, parent, tuple(prompt[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]))
        for i, (key, parent) in enumerate(chain)
    ]
    # The same prompt again: its blocks come from the cache, nothing new is cached.
    engine.add(prompt, GREEDY, chat=False)
    _run(engine)
    assert log.drain() == []
    assert log.statistics().published_blocks == 2


def test_a_salted_request_publishes_nothing_and_leaves_the_shared_chain_to_others() -> None:
    engine, _ = fake_engine(max_batch=2, context=64, prefill_chunk=64)
    log = KVEventLog()
    engine.record_kv_events(log)
    prompt = prompt_ids(40)  # two full blocks
    engine.add(prompt, GREEDY, chat=False, cache_salt=b"tenant-a")
    _run(engine)
    assert log.drain() == []  # neither a hash nor a token of the tenant's prompt
    engine.add(prompt, GREEDY, chat=False)  # the same tokens, unsalted: computed and published
    _run(engine)
    assert [r.key for r in log.drain() if isinstance(r, BlockStoredRecord)] == [
        key for key, _ in _chain(prompt)
    ]


def test_no_events_without_a_log_and_none_after_it_is_removed() -> None:
    engine, _ = fake_engine(prefill_chunk=64)
    log = KVEventLog()
    engine.record_kv_events(log)
    engine.record_kv_events(None)
    engine.add(prompt_ids(40), GREEDY, chat=False)
    _run(engine)
    assert log.drain() == []


def test_eviction_and_reset_are_recorded() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 2)
    log = KVEventLog()
    pool.events = log
    tokens = list(range(2 * BLOCK_TOKENS))
    (k0, _), (k1, _) = _chain(tokens)
    blocks = [pool.allocate(), pool.allocate()]
    assert pool.register(blocks[0], k0) and pool.register(blocks[1], k1)
    log.stored(k0, None, tokens[:BLOCK_TOKENS])
    log.stored(k1, k0, tokens[BLOCK_TOKENS:])
    pool.free(blocks)  # still cached: evictable, no event
    assert len(log.drain()) == 2
    pool.allocate()  # evicts the least recently used cached block
    assert log.drain() == [BlockRemovedRecord(k0)]
    pool.clear_cache()
    assert log.drain() == [AllClearedRecord()]
    assert log.statistics().published_blocks == 0


def test_register_says_whether_the_block_is_newly_cached() -> None:
    pool = BlockPool(RESERVED_BLOCKS + 4)
    key = block_key(None, list(range(BLOCK_TOKENS)))
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, key)
    assert not pool.register(b, key)  # the same prefix computed twice: the first is cached
    assert not pool.register(a, key)
    off = BlockPool(RESERVED_BLOCKS + 4, prefix_cache=False)
    assert not off.register(off.allocate(), key)


def test_a_chain_whose_root_was_never_published_is_never_published() -> None:
    """A salted prompt: its first block's key folds in the tenant's salt and is not published;
    no block after it may be (and no removal of them), or a subscriber would index a private
    prefix as shared and read the tenant's tokens."""
    log = KVEventLog()
    tokens = list(range(3 * BLOCK_TOKENS))
    salted_root = block_key(b"salt-of-tenant-a", tokens[:BLOCK_TOKENS])
    (k1, _), (k2, _) = _chain(tokens[BLOCK_TOKENS:], salted_root)
    log.stored(k1, salted_root, tokens[BLOCK_TOKENS : 2 * BLOCK_TOKENS])
    log.stored(k2, k1, tokens[2 * BLOCK_TOKENS :])
    log.removed(k1)
    log.removed(salted_root)
    assert log.drain() == []
    # The same tokens unsalted are published, from their first block.
    (p0, _), (p1, _) = _chain(tokens[: 2 * BLOCK_TOKENS])
    log.stored(p0, None, tokens[:BLOCK_TOKENS])
    log.stored(p1, p0, tokens[BLOCK_TOKENS : 2 * BLOCK_TOKENS])
    assert [r.key for r in log.drain() if isinstance(r, BlockStoredRecord)] == [p0, p1]


def test_after_a_reset_old_chains_are_not_continued() -> None:
    log = KVEventLog()
    tokens = list(range(2 * BLOCK_TOKENS))
    (k0, _), (k1, _) = _chain(tokens)
    log.stored(k0, None, tokens[:BLOCK_TOKENS])
    log.cleared()
    log.stored(k1, k0, tokens[BLOCK_TOKENS:])  # its parent is no longer known to anyone
    log.removed(k0)
    assert log.drain() == [
        BlockStoredRecord(k0, None, tuple(tokens[:BLOCK_TOKENS])),
        AllClearedRecord(),
    ]


def test_overflow_keeps_one_all_cleared_and_counts_the_loss() -> None:
    log = KVEventLog(capacity=4)
    keys = [block_key(None, [i] * BLOCK_TOKENS) for i in range(6)]
    for i, key in enumerate(keys):
        log.stored(key, None, [i] * BLOCK_TOKENS)
    records = log.drain()
    # 4 kept, the 5th overflowed (all 5 dropped for one "all cleared"), the 6th kept after it
    assert records == [AllClearedRecord(), BlockStoredRecord(keys[5], None, (5,) * BLOCK_TOKENS)]
    stats = log.statistics()
    assert (stats.recorded, stats.dropped, stats.overflows, stats.published_blocks) == (6, 5, 1, 1)
    log.removed(keys[0])  # dropped with the overflow: a subscriber never heard of it
    assert log.drain() == []


def test_capacity_is_checked() -> None:
    with pytest.raises(ValueError, match="capacity"):
        KVEventLog(capacity=1)


def test_a_writer_and_a_drainer_on_two_threads_lose_nothing() -> None:
    log = KVEventLog(capacity=1 << 20)
    n = 20_000
    keys = [block_key(None, [i] * BLOCK_TOKENS) for i in range(n)]
    seen: list[bytes] = []
    done = threading.Event()

    def drain() -> None:
        while not done.is_set():
            seen.extend(r.key for r in log.drain() if isinstance(r, BlockStoredRecord))
        seen.extend(r.key for r in log.drain() if isinstance(r, BlockStoredRecord))

    reader = threading.Thread(target=drain)
    reader.start()
    for key in keys:
        log.stored(key, None, ())
    done.set()
    reader.join()
    assert seen == keys
