"""Issue 25 (#6): a salted prompt shares cached prefix blocks only with the same salt.

A third party that guesses a victim's system prompt saw its first token 25x sooner on a hit;
with salts, another salt (another tenant) never hits the victim's blocks at all.
"""

from __future__ import annotations

from neuron_trio.engine.block_pool import BLOCK_TOKENS, BlockPool, block_key, salt_root
from tests.engine.drain import drain as _run
from tests.engine.fake_runner import fake_engine, greedy, prompt_ids


def test_salt_roots_are_one_way_and_apart_from_the_shared_chain() -> None:
    assert salt_root(None) is None
    a, b = salt_root(b"tenant-a"), salt_root(b"tenant-b")
    assert a is not None and b is not None and a != b and len(a) == 16
    assert b"tenant-a" not in a  # the key does not carry the salt
    tokens = list(range(BLOCK_TOKENS))
    assert len({block_key(None, tokens), block_key(a, tokens), block_key(b, tokens)}) == 3


def test_lookup_under_another_salt_finds_nothing() -> None:
    pool = BlockPool(16)
    tokens = list(range(3 * BLOCK_TOKENS))
    root = salt_root(b"victim")
    parent = root
    for i in range(3):
        block = pool.allocate()
        parent = block_key(parent, tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])
        pool.register(block, parent)
    assert len(pool.lookup(tokens, len(tokens), root)[0]) == 3
    assert pool.lookup(tokens, len(tokens))[0] == []  # no salt
    assert pool.lookup(tokens, len(tokens), salt_root(b"attacker"))[0] == []


def test_requests_share_prefixes_only_under_the_same_salt() -> None:
    # a pool large enough that the cached blocks it keeps (block_pool.BOUND_PART)
    # hold all four requests' prompts: eviction is not what this test is about
    engine, runner = fake_engine(prefill_chunk=64, blocks=64)
    system = prompt_ids(40, 7)  # two full blocks and 8 tokens
    victim = engine.add(system + [3] * 5, greedy(2), chat=False, cache_salt=b"victim")
    _run(engine)
    hits = engine.statistics().prefix_cache_hits_tokens
    # Unsalted and other-salted guesses of the same prompt: computed from scratch, no hit.
    for salt in (None, b"attacker"):
        runner.calls.clear()
        engine.add(system + [4] * 5, greedy(2), chat=False, cache_salt=salt)
        _run(engine)
        assert runner.calls[0] == (1, len(system) + 5)
        assert engine.statistics().prefix_cache_hits_tokens == hits
    # The victim's next request under its own salt reuses its two blocks.
    runner.calls.clear()
    again = engine.add(system + [5] * 5, greedy(2), chat=False, cache_salt=b"victim")
    _run(engine)
    assert runner.calls[0] == (1, len(system) + 5 - 2 * BLOCK_TOKENS)
    assert engine.statistics().prefix_cache_hits_tokens == hits + 2 * BLOCK_TOKENS
    assert victim != again
