"""The packed-weight cache: a model's built layers on disk, read back at the next start.

Under dtype "auto" on the CPU most of a load is dequantising every GGUF tensor to float32 and
packing it again for the kernels (~20 s of CPU for a 0.5B Q4_K_M file on 2 cores). The
result depends only on the file and on this build's code, so the first load writes it to one
file here (`WeightCache.store`) and later loads read it back (`WeightCache.load`) into
memory of their own, whose views the restored layers hold. The file is read, not mapped, so
that nothing done to it later can take pages from under a running model: a mapped file cut
short (even its pages already copied on write: truncation takes those too) faults with
SIGBUS, which killed the node. The copy costs ~1.5-2 s per GB on this 2-core machine under
load, against ~0.25 s to map and check it (bench/bench_startup.py; STACK-NOTES.md).

Keyed by `snapshot_key`: the GGUF file (size, mtime, header bytes with every tensor's name,
type, shape and offset, its last MiB), the scheme and device, and this build (torch's
version, the native kernel's binary and instruction set, and the source of every module that
decides what a packed layer holds: a changed packing is a new key, never a stale layout).

What a file holds: module_codec's typed nodes (each layer's class from a fixed table, its
tensors by index, its plain fields; no addresses) and the tensors, each layer built again by
its own constructor, which checks the tensors against its fields.

Robustness: a file is written to a temporary name and renamed into place (a reader sees a
whole file or none), readable by this user only (0600, in a 0700 directory); its header names
its key and layout version and carries an XXH3-64 of itself, the data an XXH3-128 (xxhash:
fast enough to check at every start, ~3 GB/s here, and a real hash: moved or swapped regions
are a miss, which a sum of words was not) checked before use. A file that is truncated,
corrupt, of another version or unreadable is logged, removed and ignored: the load packs as
if there were no cache. Writing failures (a full disk) are logged and cost only the cache.
The directory is bounded (`max_bytes`): the least recently used files go first.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import torch
import xxhash

from neuron_trio.engine.gguf import file as gguf_file
from neuron_trio.engine.gguf import quant
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model import embedding, linear, transformer
from neuron_trio.engine.model.load import layer_parts, module_codec, packing
from neuron_trio.engine.model.load.module_codec import Node, Snapshot, SnapshotError

log = logging.getLogger(__name__)

# Bump when the file format changes (what module_codec writes is covered by its source).
LAYOUT_VERSION = 2
MAGIC = b"NTWCACHE"
SUFFIX = ".nwc"
_PREFIX = struct.Struct("<8sQQ")  # magic, header length, the header's XXH3-64
_HEADER_MAX = 64 << 20  # a header past this is corrupt (the 0.5B model's is ~100 KiB)
_DATA_ALIGN = 4096  # the data region starts on a page
_READ_CHUNK = 1 << 30  # one read(2) moves at most ~2 GiB on Linux: read in chunks of this
_FILE_MODE, _DIR_MODE = 0o600, 0o700  # cached weights are the operator's: nobody else reads them
_TENSOR_ALIGN = 64  # and each tensor on a cache line, as torch's allocator aligns them
_ARRAY_SLOT = "array"  # the one slot of a `store_array` entry
_TAIL_BYTES = 1 << 20
_STALE_TEMP_S = 3600.0  # a temporary file this old is a crashed writer's: removed


class TensorEntry(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One tensor of the data region: its dtype name, shape, offset and length in bytes."""

    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class CacheHeader(msgspec.Struct, forbid_unknown_fields=True):
    """A cache file's header (msgpack, after MAGIC and its length)."""

    version: int
    key: str
    tensors: list[TensorEntry]
    slots: dict[str, Node]  # module_codec's typed node of each slot
    data_bytes: int
    digest: str  # the data region's XXH3-128, hex


@dataclass(frozen=True)
class LoadedSnapshot:
    """What `WeightCache.load` restored: each slot's module or tensor, and the file's size."""

    slots: dict[str, Any]
    nbytes: int


def _source_digest(modules: Iterable[ModuleType]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for module in modules:
        path = inspect.getsourcefile(module) or module.__file__ or ""
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


@functools.cache
def build_digest() -> str:
    """This build's part of every key: torch's version, the native kernel (its binary and
    instruction set, or none), and the source of the modules that decide a packed layer's
    content. Computed once a process (the files do not change under a running daemon)."""
    from neuron_trio.engine.model.load import loader

    kernel = packing.native_kernel()
    kernel_part = "none"
    if kernel is not None and kernel.__file__:
        so = hashlib.blake2b(Path(kernel.__file__).read_bytes(), digest_size=16).hexdigest()
        kernel_part = f"{kernel.isa()}:{so}"
    sources = _source_digest(
        [
            loader,
            linear,
            packing,
            transformer,
            embedding,
            layer_parts,
            module_codec,
            quant,
            gguf_file,
            __import__(__name__, fromlist=["_"]),
        ]
    )
    return f"torch {torch.__version__}; kernel {kernel_part}; source {sources}"


def snapshot_key(gf: GGUFFile, scheme: str, device: torch.device, options: str) -> str:
    """The cache key of `gf` loaded under `scheme` on `device` (`options`: the loader's
    switches that change what it builds): 32 hex digits."""
    stat = gf.path.stat()
    digest = hashlib.blake2b(digest_size=16)
    fields = (LAYOUT_VERSION, stat.st_size, stat.st_mtime_ns, scheme, str(device), options)
    digest.update(repr(fields).encode())
    digest.update(build_digest().encode())
    digest.update(gf.header_bytes())
    digest.update(gf.tail_bytes(_TAIL_BYTES))
    return digest.hexdigest()


def _bytes_of(t: torch.Tensor) -> memoryview:
    view: memoryview = t.reshape(-1).view(torch.uint8).numpy().data
    return view


def _private_bytes(n: int) -> torch.Tensor:
    """`n` bytes of this process's own (anonymous) memory, for the file to be read into.
    Not advised for 2 MiB pages: under THP's "madvise" defrag a fault there may wait for
    compaction (0.4-3 s for 320 MB here, against 0.5-0.7 s in 4 KiB pages)."""
    return torch.empty(n, dtype=torch.uint8)


def _read_exactly(f: Any, into: memoryview) -> None:
    """Fill `into` from `f` (a raw file); ValueError if the file ends first (truncated)."""
    done = 0
    while done < len(into):
        n = f.readinto(into[done : done + _READ_CHUNK])
        if not n:
            raise ValueError(f"the file ends {len(into) - done} bytes early")
        done += n


def _private_dir(path: Path) -> None:
    """Create `path` and any missing parent as 0700; an existing `path` is made 0700 too."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=_DIR_MODE)
    with contextlib.suppress(OSError):  # not ours to change: left as it is
        os.chmod(path, _DIR_MODE)


def _writer_alive(temp_name: str) -> bool:
    """Whether the process that is writing temporary file `.<key>.<pid>.<random>.tmp` lives."""
    try:
        pid = int(temp_name.split(".")[2])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _read_header(f: Any, key: str) -> tuple[CacheHeader, int]:
    """The header of the cache file open as `f` (checked: magic, size, hash, version, key)
    and where its data starts; ValueError if any is wrong."""
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(_PREFIX.size)
    if len(prefix) != _PREFIX.size:
        raise ValueError(f"{size} bytes: not even a header")
    magic, header_len, header_hash = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ValueError("not a weight cache file (bad magic)")
    if header_len > min(_HEADER_MAX, size):
        raise ValueError(f"a header of {header_len} bytes in a file of {size}")
    raw_header = f.read(header_len)
    if xxhash.xxh3_64_intdigest(raw_header) != header_hash:
        raise ValueError("header checksum mismatch")
    header = msgspec.msgpack.decode(raw_header, type=CacheHeader)
    if header.version != LAYOUT_VERSION or header.key != key:
        raise ValueError(f"version {header.version}, key {header.key}: not this entry")
    data_start = _align(_PREFIX.size + header_len, _DATA_ALIGN)
    if size != data_start + header.data_bytes:
        raise ValueError(f"{size} bytes, expected {data_start + header.data_bytes}")
    return header, data_start


def _data_chunks(tensors: list[torch.Tensor], entries: list[TensorEntry]) -> Iterator[Any]:
    """The data region's bytes in order: each tensor's, after the padding that aligns it."""
    at = 0
    for t, entry in zip(tensors, entries, strict=True):
        if entry.offset > at:
            yield bytes(entry.offset - at)
        if entry.nbytes:
            yield _bytes_of(t)
        at = entry.offset + entry.nbytes
    end = _align(at, _TENSOR_ALIGN)
    if end > at:
        yield bytes(end - at)


class WeightCache:
    """A directory of packed-weight snapshots (one `<key>.nwc` file each), at most
    `max_bytes` in all. Safe to share between processes: files are renamed into place whole,
    and a reader keeps its mapping even if another process evicts the file."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        *,
        min_file_bytes: int = 0,
        background: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        # Smaller model files are not cached (node.weight_cache_min_mb, 0 by default: even the
        # built-in 98 MB model's 108 MB entry saves ~1 s of each start and ~60 MB resident).
        self.min_file_bytes = min_file_bytes
        # Write new entries on a thread of their own (the load does not wait for the disk:
        # 1.85 GB took ~7 s here); False: the load writes before it returns (tests).
        self.background = background
        self._writers: list[threading.Thread] = []
        self._lock = threading.Lock()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    # ---- reading -----------------------------------------------------------------------

    def load(self, key: str) -> LoadedSnapshot | None:
        """The snapshot stored under `key`, its tensors views of memory it was read into; None if
        there is none, or if it is unusable (logged, and the file removed)."""
        path = self.path(key)
        try:
            return self._load(path, key)
        except FileNotFoundError:
            return None
        except (
            OSError,
            ValueError,
            RuntimeError,
            msgspec.DecodeError,
            SnapshotError,
            struct.error,
        ) as exc:
            log.warning(
                "weight cache: %s is unusable (%s); built again from the model file", path, exc
            )
            path.unlink(missing_ok=True)
            return None

    def _load(self, path: Path, key: str) -> LoadedSnapshot:
        with open(path, "rb", buffering=0) as f:
            header, data_start = _read_header(f, key)
            region = _private_bytes(header.data_bytes)
            f.seek(data_start)
            _read_exactly(f, _bytes_of(region))
            if f.read(1):
                raise ValueError("the file goes on past its data")
        # Checked in memory of our own: whatever happens to the file from now on, the
        # layers read what was checked.
        if xxhash.xxh3_128_hexdigest(_bytes_of(region)) != header.digest:
            raise ValueError("data checksum mismatch")
        tensors = [self._tensor(region, entry) for entry in header.tensors]
        slots = {name: module_codec.decode(node, tensors) for name, node in header.slots.items()}
        os.utime(path)  # recently used: evicted last
        return LoadedSnapshot(slots=slots, nbytes=data_start + header.data_bytes)

    @staticmethod
    def _tensor(region: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        dtype = getattr(torch, entry.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {entry.dtype!r}")
        shape = tuple(entry.shape)
        numel = 1
        for n in shape:
            if n < 0:
                raise ValueError(f"shape {shape}")
            numel *= n
        nbytes = numel * dtype.itemsize
        end = entry.offset + nbytes
        if nbytes != entry.nbytes or entry.offset % _TENSOR_ALIGN or end > region.numel():
            raise ValueError(f"tensor entry {entry} does not fit the data region")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return region[entry.offset : end].view(dtype).reshape(shape)

    # ---- writing -----------------------------------------------------------------------

    def store(self, key: str, snapshot: Snapshot) -> int | None:
        """Write `snapshot` under `key` (evicting the oldest files to make room); its size in
        bytes, or None if it was not written (too big for the cache, or an I/O error: logged)."""
        entries, offset = [], 0
        for t in snapshot.tensors:
            nbytes = t.numel() * t.element_size()
            dtype = str(t.dtype).removeprefix("torch.")
            entries.append(TensorEntry(dtype, list(t.shape), offset, nbytes))
            offset = _align(offset + nbytes, _TENSOR_ALIGN)
        data = list(_data_chunks(snapshot.tensors, entries))
        digest = xxhash.xxh3_128()
        for chunk in data:
            digest.update(chunk)
        header = msgspec.msgpack.encode(
            CacheHeader(LAYOUT_VERSION, key, entries, snapshot.slots, offset, digest.hexdigest())
        )
        data_start = _align(_PREFIX.size + len(header), _DATA_ALIGN)
        total = data_start + offset
        if total > self.max_bytes:
            log.info(
                "weight cache: %.2f GB of packed weights exceed its %.2f GB "
                "(node.weight_cache_max_mb); not cached",
                total / 1e9,
                self.max_bytes / 1e9,
            )
            return None
        temp = self.directory / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            _private_dir(self.directory)
            self.evict(room_for=total)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
            with os.fdopen(fd, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, len(header), xxhash.xxh3_64_intdigest(header)))
                f.write(header)
                f.write(bytes(data_start - f.tell()))
                for chunk in data:
                    f.write(chunk)
            os.replace(temp, self.path(key))
        except OSError as exc:
            log.warning("weight cache: could not write %s (%s); not cached", self.path(key), exc)
            temp.unlink(missing_ok=True)
            return None
        return total

    def load_array(self, key: str) -> torch.Tensor | None:
        """The single tensor `store_array` kept under `key` (a view of the memory it was read
        into), or None."""
        loaded = self.load(key)
        value = None if loaded is None else loaded.slots.get(_ARRAY_SLOT)
        return value if isinstance(value, torch.Tensor) else None

    def store_array(self, key: str, tensor: torch.Tensor) -> int | None:
        """Keep one tensor under `key` (what start-up derives besides weights, e.g. a
        tokenizer's merges): `store_logged`, on this thread."""
        snapshot = Snapshot()
        snapshot.add(_ARRAY_SLOT, tensor.contiguous())
        return self.store_logged(key, snapshot)

    def store_logged(self, key: str, snapshot: Snapshot) -> int | None:
        """`store`, logged, and never raising: the cache is an optimisation."""
        started = time.perf_counter()
        try:
            written = self.store(key, snapshot)
        except Exception:
            log.exception("weight cache: storing %s failed", self.path(key))
            return None
        if written is not None:
            log.info(
                "weight cache: stored %s (%.2f GB) in %.1f s",
                self.path(key),
                written / 1e9,
                time.perf_counter() - started,
            )
        return written

    def store_later(self, key: str, snapshot: Snapshot) -> None:
        """`store_logged` on a thread of its own (a daemon thread: `wait_for_writes` before
        the process ends, or the temporary file is left for the next eviction)."""
        thread = threading.Thread(
            target=self.store_logged, args=(key, snapshot), name="neuron-weight-cache", daemon=True
        )
        with self._lock:
            self._writers = [t for t in self._writers if t.is_alive()] + [thread]
        thread.start()

    def wait_for_writes(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` in all for the entries being written; whether all are done.

        Cancellation handling: blocking (call it on a worker thread); an abandoned wait leaves
        the writers running, and they end with the process."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            writers = list(self._writers)
        for thread in writers:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in writers)

    def evict(self, room_for: int = 0) -> list[Path]:
        """Remove the least recently used files until `room_for` more bytes fit in
        `max_bytes`, and crashed writers' temporary files; the paths removed."""
        removed: list[Path] = []
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        try:
            listing = list(self.directory.iterdir())
        except FileNotFoundError:
            return removed
        for path in listing:
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue  # another process removed it
            if path.name.endswith(".tmp") and (
                now - stat.st_mtime > _STALE_TEMP_S or not _writer_alive(path.name)
            ):
                path.unlink(missing_ok=True)
                removed.append(path)
            elif path.suffix == SUFFIX:
                files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total + room_for <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            removed.append(path)
            total -= size
            log.info("weight cache: evicted %s (%.2f GB)", path.name, size / 1e9)
        return removed
