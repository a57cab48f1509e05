"""The daemon's node trims the C heap while it serves (service/heap_trim.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import trio
import trio.testing

from neuron_trio.service.heap_trim import TRIM_EVERY_S, TRIM_FREE_BYTES, keep_trimmed


def test_the_heap_is_trimmed_each_period_while_it_holds_enough_free() -> None:
    held = [0]
    trims: list[float] = []

    async def inline(function: Callable[[], Any]) -> Any:  # no thread: the clock is mocked
        return function()

    def trim() -> None:
        trims.append(trio.current_time())

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                partial(keep_trimmed, free=lambda: held[0], trim=trim, run_sync=inline)
            )
            await trio.sleep(2.5 * TRIM_EVERY_S)
            assert trims == []  # little free: nothing to do
            held[0] = TRIM_FREE_BYTES
            await trio.sleep(2 * TRIM_EVERY_S)
            assert trims == [3 * TRIM_EVERY_S, 4 * TRIM_EVERY_S]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_without_glibc_it_returns_at_once() -> None:
    trims: list[None] = []
    trio.run(partial(keep_trimmed, free=lambda: None, trim=lambda: trims.append(None)))
    assert trims == []
