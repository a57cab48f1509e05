"""The C heap, read and trimmed through glibc: one definition for the node's three users.

glibc gives threads that allocate at once arenas of their own and hands an arena's free
memory back only from its top, so pages freed in its middle stay resident until
`malloc_trim`. Three places act on that: a model's load (executor), an evicted grammar
(engine/text/structured/grammar_cache.py) and the serving node's periodic trim
(service/heap_trim.py, through executor/api.py); and once ready the daemon caps its arenas
(`limit_arenas`, heap_trim.py), so that later threads hold no freed fragments of their own.
Rust's allocations (tokenizers, llguidance) go through this heap too. Plain ctypes, no torch:
every layer may import it. Without glibc (or before 2.33, for `mallinfo2`) the reads answer
None, and a trim or a limit does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

__all__ = ["HEAP_ARENAS", "heap_bytes", "heap_free_bytes", "limit_arenas", "release_freed_heap"]

# The daemon's malloc arenas once ready (`limit_arenas`). glibc's default is 8 a core, and each
# thread that allocates gets one of its own until then: the node's threads (compile threads,
# trio's workers) each kept tens of MB of freed fragments in theirs. Issue 47's drill (built-in
# model, two tenants, a flood of long streams and slow schemas): RSS outside the KV pool
# +213 MB with the default, +116..+156 MB with 2 arenas from the start, +152 with 4; 4 rather
# than 2 because one stream's decode through HTTP read 225-240 tok/s with 4 against 185-200
# with 2 (noisy: 170-223 by default).
HEAP_ARENAS = 4
_M_ARENA_MAX = -8  # malloc.h


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (malloc.h, glibc >= 2.33): ten size_t fields in this order
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc_function(name: str) -> Any:
    """The C library's function `name`, or None (not glibc, or too old to have it)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


_MALLINFO2 = _glibc_function("mallinfo2")
if _MALLINFO2 is not None:
    _MALLINFO2.restype, _MALLINFO2.argtypes = _MallInfo2, []
_MALLOC_TRIM = _glibc_function("malloc_trim")
if _MALLOC_TRIM is not None:
    _MALLOC_TRIM.restype, _MALLOC_TRIM.argtypes = ctypes.c_int, [ctypes.c_size_t]
_MALLOPT = _glibc_function("mallopt")
if _MALLOPT is not None:
    _MALLOPT.restype, _MALLOPT.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]


def heap_bytes() -> int | None:
    """Bytes the C heap holds in use now (allocated chunks and mmapped blocks)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def heap_free_bytes() -> int | None:
    """Bytes the arenas hold free (resident, or already trimmed and not yet reused)."""
    return None if _MALLINFO2 is None else int(_MALLINFO2().fordblks)


def limit_arenas(count: int = HEAP_ARENAS) -> bool:
    """At most `count` malloc arenas for the process (`mallopt(M_ARENA_MAX)`), unless the
    environment names its own (`MALLOC_ARENA_MAX`, which glibc read at start). Arenas already
    made stay, and a thread without one shares one of them once `count` exist. glibc fixes
    its own limit the first time more than 8 arenas exist, so a call after that changes
    nothing. True if set."""
    if "MALLOC_ARENA_MAX" in os.environ or _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_ARENA_MAX, count))


def release_freed_heap() -> None:
    """Every arena's free pages back to the system (`malloc_trim(0)`)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
