"""An evicted grammar's memory goes back to the system (grammar_cache.py): the C heap is
trimmed once the evicted entry is freed, for evictions of at least TRIM_AFTER_BYTES."""

from __future__ import annotations

import weakref

import pytest

from neuron_trio.engine.text.structured import grammar_cache
from neuron_trio.engine.text.structured.grammar_cache import TRIM_AFTER_BYTES, GrammarCache


class _Grammar:
    """Stands for a compiled grammar (weakly referable, so that its release can be seen)."""


class _Trims:
    """The trims the cache asked for: for each, whether the watched grammar was freed."""

    def __init__(self) -> None:
        self.watched: weakref.ref[_Grammar] | None = None
        self.freed: list[bool] = []

    def __call__(self) -> None:
        self.freed.append(self.watched is not None and self.watched() is None)


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> _Trims:
    recorder = _Trims()
    monkeypatch.setattr(grammar_cache, "release_freed_heap", recorder)
    return recorder


def test_a_large_eviction_trims_the_heap_after_the_entry_is_freed(trims: _Trims) -> None:
    cache = GrammarCache(max_entries=8, max_bytes=2 * TRIM_AFTER_BYTES)
    big = _Grammar()
    trims.watched = weakref.ref(big)
    cache.put("a", big, TRIM_AFTER_BYTES)
    del big
    cache.put("b", _Grammar(), TRIM_AFTER_BYTES)
    assert trims.freed == []  # both fit: nothing evicted
    cache.put("c", _Grammar(), TRIM_AFTER_BYTES)  # "a" goes
    assert trims.freed == [True]  # one trim, after "a" was freed


def test_small_evictions_do_not_trim(trims: _Trims) -> None:
    cache = GrammarCache(max_entries=2, max_bytes=1 << 30)
    for i in range(4):
        cache.put(i, _Grammar(), TRIM_AFTER_BYTES // 4)
    assert cache.statistics().evictions == 2
    assert trims.freed == []
