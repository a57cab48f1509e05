"""One load's use of the packed-weight cache: each built layer or table is a named slot,
restored from the cache on a hit, built and recorded on a miss, stored when the load ends.

The loader asks `slots.slot(name, build)` for every expensive part (a projection, the
embedding, the head); `build` runs only when the cache has no such slot. After the last slot
`finish()` writes what was recorded. Nothing here may fail a load: a cache that cannot be
read, a layer that cannot be recorded (`module_codec.UncacheableError`) or a file that cannot
be written only costs the cache, and is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.load.load_phases import LoadPhases
from neuron_trio.engine.model.load.module_codec import Snapshot, UncacheableError
from neuron_trio.engine.model.load.weight_cache import WeightCache, snapshot_key

log = logging.getLogger(__name__)

T = TypeVar("T", nn.Module, torch.Tensor)


class Slots:
    """The slots of one load: from the cache (`hit`), recorded for it, or neither (no cache,
    or the model cannot be cached)."""

    def __init__(
        self,
        phases: LoadPhases,
        cache: WeightCache | None = None,
        key: str = "",
        restored: dict[str, nn.Module | torch.Tensor] | None = None,
    ) -> None:
        self.phases = phases
        self.cache = cache
        self.key = key
        self.restored = restored
        self.recording = Snapshot() if cache is not None and restored is None else None
        self.incomplete = False  # a hit that lacked a slot: the entry is dropped at the end

    @property
    def hit(self) -> bool:
        return self.restored is not None

    def slot(self, name: str, build: Callable[[], T]) -> T:
        """The slot `name`: restored, or `build()` (then recorded for the cache)."""
        if self.restored is not None:
            value = self.restored.get(name)
            if value is not None:
                return value  # type: ignore[return-value]
            self.incomplete = True
        value = build()
        if self.recording is not None:
            try:
                self.recording.add(name, value)
            except UncacheableError as exc:
                self._give_up(f"{name} cannot be cached ({exc})")
        return value

    def moved(self, copies: dict[int, torch.Tensor]) -> None:
        """Tensors the load moved after they were recorded (arena.gather, by old address):
        the cache stores their copies, and the old ones can be freed now."""
        if self.recording is not None:
            self.recording.replace_tensors(copies)

    def _give_up(self, why: str) -> None:
        log.info("weight cache: %s; this model is not cached", why)
        self.phases.note(f"weight cache: {why}")
        self.recording = None

    def finish(self) -> None:
        """Store what was recorded (a miss), or drop an entry that lacked a slot (a hit)."""
        if self.cache is None:
            return
        if self.incomplete:
            log.warning("weight cache: %s lacked a slot; removed", self.cache.path(self.key))
            self.cache.path(self.key).unlink(missing_ok=True)
            return
        recording, self.recording = self.recording, None
        if recording is None:
            return
        if self.cache.background:
            self.phases.note("weight cache miss: storing in the background")
            self.cache.store_later(self.key, recording)
            return
        with self.phases.phase("weight cache"):
            written = self.cache.store_logged(self.key, recording)
        if written is not None:
            self.phases.note(f"weight cache miss: stored {written / 1e9:.2f} GB")
        else:
            self.phases.note("weight cache miss: not stored (see the log)")


def open_slots(
    gf: GGUFFile,
    cache: WeightCache | None,
    scheme: str,
    device: torch.device,
    options: str,
    phases: LoadPhases,
) -> Slots:
    """The slots of loading `gf` under `scheme` on `device` (`options`: the loader's switches
    that change what it builds): a hit if `cache` holds them. `cache` None: no cache."""
    if cache is None:
        return Slots(phases)
    if gf.path.stat().st_size < cache.min_file_bytes:
        phases.note("weight cache: not used for a file this small (node.weight_cache_min_mb)")
        return Slots(phases)
    with phases.phase("weight cache"):
        key = snapshot_key(gf, scheme, device, options)
        loaded = cache.load(key)
    if loaded is None:
        return Slots(phases, cache, key)
    phases.note(f"weight cache hit: {loaded.nbytes / 1e9:.2f} GB read")
    return Slots(phases, cache, key, loaded.slots)
