"""`collections_paused`: no automatic garbage collection while a tokenizer is built.

Why: building a vocabulary's tables makes hundreds of thousands of container objects at once
(Gemma 3's 513,511 merges are as many tuples of token texts, handed to `tokenizers` and
freed when the build returns), and the collector ran its young and middle collections over
them as they were made, then a full one once they outnumbered a quarter of the heap: ~0.07
of the 0.13 s that Gemma 3's merges took as tuples. None of those objects is in a cycle (the
build's tables are plain lists, dicts and tuples of strings, bytes and ints), so nothing a
collection could find is lost by pausing; what the build keeps is collected after the load
(the daemon's `service.heap.settle`).

The collector's switch is the process's: a pause is counted (builds on two threads at once,
e.g. two models loading), and collection resumes when the last one ends, only if it was on
when the first one began.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_paused = 0
_resume = False  # whether the collector was on when the first pause began


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    global _paused, _resume
    with _lock:
        if _paused == 0:
            _resume = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _lock:
            _paused -= 1
            if _paused == 0 and _resume:
                gc.enable()
