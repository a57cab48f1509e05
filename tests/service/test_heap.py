"""service/heap.py: the daemon's long-lived objects out of the collector's walks, and back in
for an unload. Run against the real collector (its state restored after each test)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from neuron_trio.service import heap


class Blob:
    """A cycle: it refers to itself, so only the collector can free it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    saved = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*saved)


def test_settle_frees_the_loads_garbage_then_freezes_the_rest() -> None:
    left_behind = Blob()
    gone = weakref.ref(left_behind)
    del left_behind  # garbage before the freeze: collected, not frozen
    kept = Blob()
    heap.settle()
    assert gone() is None
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[2] == heap.FULL_AFTER
    assert all(o is not kept for o in gc.get_objects())  # out of every generation


def test_release_frees_a_cycle_that_died_frozen_and_freezes_the_rest_again() -> None:
    model = Blob()
    freed = weakref.ref(model)
    heap.settle()
    del model  # an unloaded model's cycle: frozen, so a collection does not see it
    gc.collect()
    assert freed() is not None
    heap.release()
    assert freed() is None
    assert gc.get_freeze_count() > 0
