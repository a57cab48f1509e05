"""service/heap.py: the daemon's long-lived objects out of the collector's walks, and back in
for an unload. Run against the real collector (its state restored after each test)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

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
    gc.enable()
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


def test_the_daemons_imports_are_frozen_before_its_first_load(tmp_path: Path) -> None:
    # The real daemon's node factory runs once its imports (torch's) are done: it freezes
    # them and turns automatic collections back on (cli's `serve` turned them off), so that
    # the load's collections and `settle`'s do not walk ~170,000 imported objects again.
    from neuron_trio import daemon
    from neuron_trio.config import config_from_mapping

    heap.defer_collections()
    assert not gc.isenabled()
    state = {"node": {"state_dir": str(tmp_path / "state")}}
    config = config_from_mapping(state, origin="test", environ={})
    daemon._default_node_factory(config, identity=None, gpus=None, notifier=None)  # type: ignore[arg-type]
    assert gc.isenabled() and gc.get_freeze_count() > 0
