"""The cyclic garbage collector's view of the daemon's long-lived objects.

Why: a loaded model, its tokenizer, its grammar compiler and the daemon's own modules are
~200,000 objects that live as long as the process, and every full collection walked all of
them and what they hold (vocabularies of 50,000 to 260,000 entries): 80-460 ms a collection,
on whichever thread allocated, most often the event loop's. Measured on the built-in model:
4,096 connections that one client opened and closed at once set off 8 full collections
(2.3 s in all), none of which found anything, and /health took up to 2.2 s to answer.

So once a load is done the heap is collected and what is left frozen (`gc.freeze`): full
collections walk only what requests create. And a full collection comes after FULL_AFTER
collections of the middle generation instead of CPython's 10, so that a burst of objects
that all stay alive (those 4,096 connections) is walked once or twice, not eight times. The
young collections stay as frequent as CPython's: most of a request's garbage dies there, and
some of it holds native memory (a compiled grammar: megabytes in Rust), which a young
generation of 10,000 instead of 700 kept ~250 MB longer in the grammar drill. With both, and
with fix 8 of http/wire/_hypercorn_fixes.py: /health answered within 0.6-0.8 s of those 4,096
closes (1.5-2.2 s before), and within 0.4 s while they opened (0.4-1.5 s before).

The daemon's start does the same for its modules (torch's ~170,000 objects among them):
automatic collections are off while it imports (`defer_collections`; the four full ones
that ran during Qwen2.5 0.5B's start found 0-20 objects and took ~0.25 s in all), and what the
imports made is frozen before the first model loads (`freeze_imports`), so the load's
collections, and `settle`'s, walk only what the load made (settle: ~0.15 s -> ~0.01 s).

Frozen objects are still freed when their last reference goes; only a cycle among them would
outlive its references. So an unload thaws the heap first, so that the model's cycles are
found, and freezes what is left again. Only the daemon's node does this (`Node(settle_heap=
True)`): a process that holds other objects (a test run) keeps the collector as it was.
"""

from __future__ import annotations

import gc

__all__ = ["FULL_AFTER", "defer_collections", "freeze_imports", "release", "settle"]

# Middle-generation collections between full ones (CPython's default: 10).
FULL_AFTER = 100


def defer_collections() -> None:
    """Before the daemon imports its modules: no automatic collection until
    `freeze_imports` (modules stay alive: a collection during the imports finds nothing)."""
    gc.disable()


def freeze_imports() -> None:
    """Once the daemon's modules are imported, before a model loads: freeze what exists,
    then collect automatically again (the imports' objects stay out of every later walk)."""
    gc.freeze()
    gc.enable()


def settle() -> None:
    """After a load: free what it left behind (cycles too), then freeze the rest, and space
    out full collections. Blocks (holding the GIL) for one full collection: call it off the
    event loop."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_AFTER)


def release() -> None:
    """After an unload: thaw the heap so that the model's own cycles are found, then settle."""
    gc.unfreeze()
    settle()
