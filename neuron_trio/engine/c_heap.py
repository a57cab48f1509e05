"""The C heap, read and trimmed through glibc: one definition for the node's three users.

glibc gives threads that allocate at once arenas of their own and hands an arena's free
memory back only from its top, so pages freed in its middle stay resident until
`malloc_trim`. Three places act on that: a model's load (executor), an evicted grammar
(engine/text/structured/grammar_cache.py) and the serving node's periodic trim
(service/heap_trim.py, through executor/api.py). Rust's allocations (tokenizers,
llguidance) go through this heap too. Plain ctypes, no torch: every layer may import it.
Without glibc (or before 2.33, for `mallinfo2`) the reads answer None and a trim does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

__all__ = ["heap_bytes", "heap_free_bytes", "release_freed_heap"]


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


def heap_bytes() -> int | None:
    """Bytes the C heap holds in use now (allocated chunks and mmapped blocks)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def heap_free_bytes() -> int | None:
    """Bytes the arenas hold free (resident, or already trimmed and not yet reused)."""
    return None if _MALLINFO2 is None else int(_MALLINFO2().fordblks)


def release_freed_heap() -> None:
    """Every arena's free pages back to the system (`malloc_trim(0)`)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
