"""The packed-weight cache: a model's built layers on disk, memory-mapped at the next start.

Under dtype "auto" on the CPU most of a load is dequantising every GGUF tensor to float32 and
packing it again for the kernels (~20 s of CPU for a 0.5B Q4_K_M file on 2 cores). The
result depends only on the file and on this build's code, so the first load writes it to one
file here (`WeightCache.store`) and later loads map that file (`WeightCache.load`): the
tensors are views of the mapping (copy-on-write, never written), read from the page cache on
first touch, so a warm start costs little more than mapping it.

Keyed by `snapshot_key`: the GGUF file (size, mtime, header bytes with every tensor's name,
type, shape and offset, its last MiB), the scheme and device, and this build (torch's
version, the native kernel's binary and instruction set, and the source of every module that
decides what a packed layer holds: a changed packing is a new key, never a stale layout).

Robustness: a file is written to a temporary name and renamed into place (a reader sees a
whole file or none); its header names its key and layout version and has a CRC-32; the data
carries a checksum (the sum of its 64-bit words) checked before use. A file that is truncated, corrupt,
of another version or unreadable is logged, removed and ignored: the load packs as if there
were no cache. Writing failures (a full disk) are logged and cost only the cache. The
directory is bounded (`max_bytes`): the least recently used files go first.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import mmap
import os
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import torch

from neuron_trio.engine.gguf import file as gguf_file
from neuron_trio.engine.gguf import quant
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model import embedding, linear, module_codec, packing, transformer
from neuron_trio.engine.model.module_codec import Snapshot, SnapshotError

log = logging.getLogger(__name__)

# Bump when the file format changes (what module_codec writes is covered by its source).
LAYOUT_VERSION = 1
MAGIC = b"NTWCACHE"
SUFFIX = ".nwc"
_PREFIX = struct.Struct("<8sQI")  # magic, header length, the header's CRC-32
_HEADER_MAX = 64 << 20  # a header past this is corrupt (the 0.5B model's is ~100 KiB)
_DATA_ALIGN = 4096  # the data region starts on a page
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
    slots: dict[str, Any]  # module_codec's encoding of each slot
    data_bytes: int
    checksum: int  # the data region's 64-bit words summed, modulo 2**64


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
    from neuron_trio.engine.model import loader  # its packing decisions (not at import: a cycle)

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


def _word_sum(data: torch.Tensor) -> int:
    """Sum of `data`'s bytes as little-endian 64-bit words (zero-padded), modulo 2**64."""
    flat = data.reshape(-1).view(torch.uint8)
    whole = flat.numel() // 8 * 8
    total = int(flat[:whole].view(torch.int64).sum()) if whole else 0
    if whole < flat.numel():
        tail = bytes(flat[whole:].tolist()) + bytes(8 - (flat.numel() - whole))
        total += int.from_bytes(tail, "little", signed=True)
    return total % (1 << 64)


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
        """The snapshot stored under `key`, its tensors views of the mapped file; None if
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
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            magic, header_len, header_crc = _PREFIX.unpack(f.read(_PREFIX.size))
            if magic != MAGIC:
                raise ValueError("not a weight cache file (bad magic)")
            if header_len > min(_HEADER_MAX, size):
                raise ValueError(f"a header of {header_len} bytes in a file of {size}")
            raw_header = f.read(header_len)
            if zlib.crc32(raw_header) != header_crc:
                raise ValueError("header checksum mismatch")
            header = msgspec.msgpack.decode(raw_header, type=CacheHeader)
            if header.version != LAYOUT_VERSION or header.key != key:
                raise ValueError(f"version {header.version}, key {header.key}: not this entry")
            data_start = _align(_PREFIX.size + header_len, _DATA_ALIGN)
            if size != data_start + header.data_bytes:
                raise ValueError(f"{size} bytes, expected {data_start + header.data_bytes}")
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        region = (
            torch.frombuffer(mapping, dtype=torch.uint8, offset=data_start, count=header.data_bytes)
            if header.data_bytes
            else torch.empty(0, dtype=torch.uint8)
        )
        if _word_sum(region) != header.checksum:
            raise ValueError("checksum mismatch")
        # The check read every page into this process, and they stay mapped (handing them back
        # with madvise(DONTNEED) lowers the RSS after load, but the warm-up faults them in
        # again: on a busy machine it looked slower, so the pages stay).
        tensors = [self._tensor(region, entry) for entry in header.tensors]
        slots = {name: module_codec.decode(node, tensors) for name, node in header.slots.items()}
        os.utime(path)  # recently used: evicted last
        return LoadedSnapshot(slots=slots, nbytes=size)

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
        checksum = sum(_word_sum(t) for t in snapshot.tensors if t.numel()) % (1 << 64)
        header = msgspec.msgpack.encode(
            CacheHeader(LAYOUT_VERSION, key, entries, snapshot.slots, offset, checksum)
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
            self.directory.mkdir(parents=True, exist_ok=True)
            self.evict(room_for=total)
            with open(temp, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, len(header), zlib.crc32(header)))
                f.write(header)
                f.write(bytes(data_start - f.tell()))
                for t, entry in zip(snapshot.tensors, entries, strict=True):
                    f.write(bytes(data_start + entry.offset - f.tell()))  # alignment padding
                    if entry.nbytes:
                        f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                f.write(bytes(total - f.tell()))
            os.replace(temp, self.path(key))
        except OSError as exc:
            log.warning("weight cache: could not write %s (%s); not cached", self.path(key), exc)
            temp.unlink(missing_ok=True)
            return None
        return total

    def load_array(self, key: str) -> torch.Tensor | None:
        """The single tensor `store_array` kept under `key` (a view of the mapped file), or
        None."""
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
