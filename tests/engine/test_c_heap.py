"""engine/c_heap.py: the C heap's use and free bytes read, freed pages handed back."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from neuron_trio.engine.c_heap import (
    HEAP_ARENAS,
    heap_bytes,
    heap_free_bytes,
    limit_arenas,
    release_freed_heap,
)

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


_ARENAS_SCRIPT = """
import ctypes, sys, threading
from neuron_trio.engine.c_heap import limit_arenas
print(limit_arenas() if sys.argv[1] == "limit" else False)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
together = threading.Barrier(9)
def allocate():
    libc.malloc(100_000)  # below the mmap threshold: from the thread's arena
    together.wait()
    together.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
together.wait()
libc.malloc_stats()  # one "Arena N:" section each, on standard error
together.wait()
"""


@pytest.mark.skipif(not HAS_TRIM, reason="the C library has no mallopt arenas (not glibc)")
def test_the_daemons_threads_share_a_few_arenas() -> None:
    def arenas(mode: str) -> tuple[str, int]:
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        done = subprocess.run(
            [sys.executable, "-c", _ARENAS_SCRIPT, mode],
            capture_output=True, text=True, env=env, timeout=60, check=True,
        )  # fmt: skip
        return done.stdout.strip(), done.stderr.count("Arena ")

    assert arenas("limit") == ("True", HEAP_ARENAS)
    assert arenas("default")[1] > HEAP_ARENAS + 2  # eight threads allocating at once


def test_an_arena_count_in_the_environment_is_the_operators(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_arenas() is False
