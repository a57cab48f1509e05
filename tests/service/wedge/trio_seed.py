"""Seeding trio's scheduler, which reverses each batch of runnable tasks at random, so a test can
run one scenario under many task orders and replay any of them."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

from trio._core import _run as trio_run_internals


@contextmanager
def trio_seed(seed: int) -> Iterator[None]:
    """Seed trio's scheduler randomness for one run; restore it afterwards."""
    rng: random.Random = trio_run_internals._r
    state = rng.getstate()
    rng.seed(seed)
    try:
        yield
    finally:
        rng.setstate(state)
