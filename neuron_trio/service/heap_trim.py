"""The C heap's free pages handed back to the system while the daemon serves.

Why: glibc gives threads that allocate at once arenas of their own (up to 8 a core) and
gives an arena's free memory back only from its top, so pages freed in its middle stay
resident. The node's threads free in bursts (a prefill's activations, a finished request's
grammar state, an evicted grammar), and what they freed stayed counted in RSS: in issue 47's
drill (built-in model, two tenants, a flood of long streams and slow schemas) glibc's
`malloc_stats` at the end showed one arena of 121 MB holding 19 MB in use, and ~130 MB free
in all, for RSS +226..+238 MB outside the KV pool.

So every `TRIM_EVERY_S` the daemon's node reads how much the heap holds free (`mallinfo2`)
and, from `TRIM_FREE_BYTES` up, calls `malloc_trim(0)` on a worker thread: each arena's free
pages go back (0.4 ms on the built-in model's node with nothing left to hand back; an arena
is locked while it is trimmed). Free bytes count trimmed pages too, so a node that keeps that
much free trims every period: cheap, as pages already given back cost nothing to give again.
Nothing without glibc (engine/c_heap.py reads and trims).

Once the node's default models are ready it also caps glibc's malloc arenas
(`limit_arenas`, engine/c_heap.py): the threads that come later (compiles, trio's workers)
share the arenas start-up made instead of each freeing into one of its own. Not before:
capped during start-up, the tokenizer's build shared an arena with the weights' load and
Gemma 3 was ready ~0.4 s later. Only the daemon's node runs it (`Node(settle_heap=True)`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from neuron_trio.executor.api import heap_free_bytes, limit_arenas, release_freed_heap

__all__ = ["TRIM_EVERY_S", "TRIM_FREE_BYTES", "keep_trimmed", "limit_arenas"]

TRIM_EVERY_S = 10.0
TRIM_FREE_BYTES = 32 << 20


async def keep_trimmed(
    *,
    every_s: float = TRIM_EVERY_S,
    free: Callable[[], int | None] = heap_free_bytes,
    trim: Callable[[], None] = release_freed_heap,
    run_sync: Callable[[Callable[[], Any]], Awaitable[Any]] = trio.to_thread.run_sync,
) -> None:
    """Forever (until cancelled): every `every_s`, trim the heap if it holds at least
    `TRIM_FREE_BYTES` free (both on a worker thread: `run_sync`)."""
    if free() is None:
        return  # not glibc: nothing to read, nothing to trim
    while True:
        await trio.sleep(every_s)
        held = await run_sync(free)
        if held is not None and held >= TRIM_FREE_BYTES:
            await run_sync(trim)
