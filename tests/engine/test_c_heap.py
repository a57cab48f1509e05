"""engine/c_heap.py: the C heap's use and free bytes read, freed pages handed back."""

from __future__ import annotations

import ctypes

import pytest

from neuron_trio.engine.c_heap import heap_bytes, heap_free_bytes, release_freed_heap

LIBC = ctypes.CDLL(None)
HAS_TRIM = getattr(LIBC, "malloc_trim", None) is not None


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not HAS_TRIM, reason="the C library has no malloc_trim (not glibc)")
def test_freed_small_blocks_under_a_live_one_leave_the_resident_set() -> None:
    malloc, free = LIBC.malloc, LIBC.free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    blocks = [malloc(1024) for _ in range(64 * 1024)]  # 64 MiB of heap, below the mmap threshold
    for block in blocks:
        ctypes.memset(block, 1, 1024)  # resident
    pin = malloc(1024)  # a live block above them: glibc's own trim at free() cannot reach them
    for block in blocks:
        free(block)
    before = _rss_anon_kib()
    free_bytes = heap_free_bytes()
    assert free_bytes is not None and free_bytes > 32 << 20, free_bytes  # the freed blocks
    release_freed_heap()
    after = _rss_anon_kib()
    free(pin)
    assert before - after > 32 * 1024, (before, after)  # most of the 64 MiB went back


@pytest.mark.skipif(not HAS_TRIM, reason="the C library has no mallinfo2 (not glibc)")
def test_heap_bytes_follow_what_is_allocated() -> None:
    malloc, free = LIBC.malloc, LIBC.free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    start = heap_bytes()
    assert start is not None
    blocks = [malloc(4096) for _ in range(4096)]  # 16 MiB
    grown = heap_bytes()
    for block in blocks:
        free(block)
    assert grown is not None and grown - start >= 15 << 20, (start, grown)
