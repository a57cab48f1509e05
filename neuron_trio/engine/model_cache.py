"""Loaded models kept on disk, so that a restart does not dequantise and repack every weight.

Loading the built-in model on 2 CPU cores under `dtype = "auto"` spends seconds turning each
GGUF block into float32 and packing it for the int4/int8 kernels (loader.py); reading the
packed model back is one sequential read (under a second). So after a load, the model as
`load_transformer` built it is written to `<cache_dir>/<key>.pt` (on a background thread,
atomically: a temporary file, then a rename), and the next load with the same key reads it.
It is read, not memory-mapped: the first forwards over a mapped file paid its page faults
(measured on 2 busy cores: the warm-up took 2-3x the CPU time of one over read weights).

The key covers everything the packed tensors depend on: the model file (resolved path, size,
modification time), the dtype and device type, this cache's format, neuron's and torch's
versions, and the bytes of every module of the engine package (a changed loader, quantiser or
model invalidates every entry). At most MAX_ENTRIES files are kept (least recently used
removed first). Only whole models on the CPU are cached (tp = 1; CUDA loads are dominated by
the copy to the device, and TP shards are cut from one shared dequantisation). A write that
would leave less than MIN_FREE_BYTES free on the disk is skipped.

Reading a cache file never runs code from it: it is unpickled with torch's `weights_only`
loader, allowing only the engine's own classes and torch's module containers; a file that
names anything else, or fails to load, is removed and the model is loaded from its GGUF file.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

import neuron_trio
from neuron_trio.engine.gguf_file import GGUFFile
from neuron_trio.engine.loader import load_transformer
from neuron_trio.engine.model import Transformer

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
MAX_ENTRIES = 4
MIN_FREE_BYTES = 4 << 30  # a write that would leave less free on the disk is skipped
SUFFIX = ".pt"
_ENGINE_DIR = Path(__file__).resolve().parent
# Globals a cache file may name: the engine's own classes, and torch's module containers.
_ALLOWED_PREFIXES = ("neuron_trio.engine.", "torch.nn.modules.")


def _engine_digest() -> str:
    digest = hashlib.sha256()
    for source in sorted(_ENGINE_DIR.glob("*.py")):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


def cache_key(path: str | os.PathLike[str], dtype: str, device: torch.device) -> str:
    """The name of `path`'s cache entry under `dtype` on `device` (a hex digest)."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    identity = {
        "format": CACHE_FORMAT,
        "neuron": neuron_trio.__version__,
        "torch": torch.__version__,
        "engine": _engine_digest(),
        "file": str(resolved),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": dtype,
        "device": device.type,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def _allowed_globals(entry: Path) -> list[Any] | None:
    """The classes `entry` names, imported, if all are allowed; None if any is not."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(str(entry))
    allowed: list[Any] = []
    for name in names:
        if not name.startswith(_ALLOWED_PREFIXES):
            log.warning("model cache: %s names %s: not loading it", entry.name, name)
            return None
        module, _, attribute = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attribute))
    return allowed


def load_cached(entry: Path) -> Transformer | None:
    """The model stored in `entry`, or None if there is none or it is unusable (then it is
    removed)."""
    if not entry.is_file():
        return None
    try:
        allowed = _allowed_globals(entry)
        if allowed is not None:
            with torch.serialization.safe_globals(allowed):
                model = torch.load(entry, weights_only=True, map_location="cpu")
            if isinstance(model, Transformer):
                os.utime(entry)  # least recently used goes first
                return model
            log.warning("model cache: %s holds a %s, not a model", entry.name, type(model).__name__)
    except Exception as exc:
        log.warning("model cache: cannot read %s (%s: %s)", entry.name, type(exc).__name__, exc)
    entry.unlink(missing_ok=True)
    return None


def model_bytes(model: Transformer) -> int:
    """Bytes of the model's tensors (a storage shared by several counted once)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(model)
    }
    return sum(storages.values())


def _tensors(model: Transformer) -> list[torch.Tensor]:
    return [t for t in model.state_dict(keep_vars=True).values() if t.device.type != "meta"]


def store(entry: Path, model: Transformer) -> bool:
    """Write `model` to `entry` atomically, then keep only the MAX_ENTRIES newest entries.

    Skipped (False) when the disk would keep less than MIN_FREE_BYTES free after the write:
    the cache saves start-up time, never at the cost of a full disk.
    """
    entry.parent.mkdir(parents=True, exist_ok=True)
    size = model_bytes(model)
    free = shutil.disk_usage(entry.parent).free
    if free - size < MIN_FREE_BYTES:
        log.warning(
            "model cache: not writing %s: %.1f GiB would leave %.1f GiB free (less than %.0f)",
            entry.name,
            size / 2**30,
            (free - size) / 2**30,
            MIN_FREE_BYTES / 2**30,
        )
        return False
    temporary = entry.with_name(f".{entry.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        torch.save(model, temporary)
        os.replace(temporary, entry)
    finally:
        temporary.unlink(missing_ok=True)
    prune(entry.parent)
    return True


def prune(cache_dir: Path, keep: int = MAX_ENTRIES) -> None:
    """Remove all but the `keep` most recently used entries, and temporary files left by a
    process that stopped while writing (older than an hour)."""
    entries = sorted(cache_dir.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        old.unlink(missing_ok=True)
    for leftover in cache_dir.glob(".*.tmp"):
        if time.time() - leftover.stat().st_mtime > 3600:
            leftover.unlink(missing_ok=True)


def load_transformer_cached(
    gguf: GGUFFile,
    *,
    dtype: str,
    device: torch.device,
    cache_dir: Path,
    background: bool = True,
) -> Transformer:
    """`load_transformer(gguf, dtype=dtype, device=device)`, from the cache when it holds this
    model; otherwise loaded from the file, then stored (on a background thread unless not
    `background`: the load's caller need not wait for the write)."""
    if device.type != "cpu":
        return load_transformer(gguf, dtype=dtype, device=device)
    entry = cache_dir / (cache_key(gguf.path, dtype, device) + SUFFIX)
    started = time.monotonic()
    model = load_cached(entry)
    if model is not None:
        log.info("model cache: read %s in %.2f s", entry, time.monotonic() - started)
        return model
    model = load_transformer(gguf, dtype=dtype, device=device)

    def write() -> None:
        try:
            if store(entry, model):
                log.info("model cache: wrote %s for the next start", entry)
        except Exception as exc:  # a full disk costs the next start time, nothing else
            log.warning("model cache: cannot write %s (%s: %s)", entry, type(exc).__name__, exc)

    if background:
        # Not a daemon thread: the interpreter waits for it at exit (a second or two), since
        # one killed inside torch.save aborts the process (std::terminate) instead of exit 0.
        threading.Thread(target=write, name="neuron-model-cache").start()
    else:
        write()
    return model
