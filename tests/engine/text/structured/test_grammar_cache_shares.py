"""Issue 47: the grammar cache's bounds are shared fairly between the tenants that put
entries. Before, one LRU for all: a tenant's stream of distinct large schemas evicted every
other tenant's grammars (they compiled again, seconds each) and kept the whole budget.

Fails on the code before: `put` took no owner, and eviction was least recently used first
whoever had put the entry."""

from __future__ import annotations

from dataclasses import replace

from neuron_trio.engine.text.structured.grammar_cache import GrammarCache
from neuron_trio.engine.types import Constraint

MB = 1 << 20


def _keys(cache: GrammarCache) -> set[object]:
    return {key for key in ("c0", "c1", "c2") if cache.get(key) is not None}


def test_a_tenants_churn_of_large_grammars_recycles_its_own_share() -> None:
    cache = GrammarCache(max_entries=64, max_bytes=100 * MB)
    for i in range(3):
        cache.put(f"c{i}", object(), 10 * MB, owner="calm")
    for i in range(10):
        cache.put(f"f{i}", object(), 40 * MB, owner="flood")
    assert _keys(cache) == {"c0", "c1", "c2"}  # calm, within its share, lost nothing
    flood = [f"f{i}" for i in range(10) if cache.get(f"f{i}") is not None]
    assert flood == ["f9"]  # two of 40 MB would pass flood's half of 100 MB
    assert cache.statistics().estimated_bytes == 70 * MB


def test_alone_a_tenant_may_fill_the_whole_cache() -> None:
    cache = GrammarCache(max_entries=64, max_bytes=100 * MB)
    for i in range(5):
        cache.put(f"f{i}", object(), 40 * MB, owner="flood")
    assert [i for i in range(5) if cache.get(f"f{i}") is not None] == [3, 4]  # plain LRU


def test_entries_are_shared_as_bytes_are() -> None:
    cache = GrammarCache(max_entries=8, max_bytes=100 * MB)
    for i in range(2):
        cache.put(f"c{i}", object(), MB, owner="calm")
    for i in range(20):
        cache.put(f"f{i}", object(), MB, owner="flood")
    assert _keys(cache) == {"c0", "c1"}
    assert len(cache) == 6  # flood keeps half of the 8 entries, calm its 2


def test_a_full_cache_takes_from_the_tenant_holding_most() -> None:
    cache = GrammarCache(max_entries=64, max_bytes=80 * MB)
    cache.put("a0", object(), 30 * MB, owner="a")
    cache.put("b0", object(), 10 * MB, owner="b")
    cache.put("b1", object(), 10 * MB, owner="b")
    cache.put("a1", object(), 5 * MB, owner="a")  # a: 35 MB of its 40 (two tenants)
    cache.put("c0", object(), 30 * MB, owner="c")  # 85 MB: over; a holds most
    assert cache.get("a0") is None
    assert all(cache.get(k) is not None for k in ("a1", "b0", "b1", "c0"))


def test_owner_is_not_part_of_a_constraints_key() -> None:
    """Tenants of one prefix-cache group share a compile (their scope is the group's); the
    entry stays charged to whoever compiled it."""
    one = Constraint("json", schema='{"type":"object"}', scope=b"group", owner="beta")
    other = replace(one, owner="gamma")
    assert one == other and hash(one) == hash(other)
    cache = GrammarCache()
    cache.put(one, "compiled", MB, owner=one.owner)
    assert cache.get(other) == "compiled"
