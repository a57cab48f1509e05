"""The `/v1/node` document (docs/DESIGN.md): every type of it in one module.

`Node.info()` builds a `NodeInfo`; each model's entry is its actor's `ModelInfo`, which embeds
the rank shapes (`RankInfo`) and the watchdog's own statistics (`WatchdogStatistics`) as they
are, so a field is defined once. `neuron status` reads the same document.
"""

from __future__ import annotations

from typing import Any

import msgspec

from neuron_trio.engine.block_pool import BLOCK_TOKENS
from neuron_trio.executor.api import RankInfo
from neuron_trio.service.metrics.model import ModelActorStatistics
from neuron_trio.service.wedge.forensics import LastForensics
from neuron_trio.service.wedge.records import WatchdogStatistics


class ModelMemory(msgspec.Struct, frozen=True):
    """What placement estimated for a model, and the devices it chose (`/v1/node`)."""

    weights_bytes: int
    kv_cache_bytes: int
    total_bytes: int
    devices: list[str]


class KVCacheInfo(msgspec.Struct, frozen=True):
    """A model's paged KV cache in `/v1/node`: blocks of `block_tokens` tokens."""

    block_tokens: int
    blocks_total: int  # the pool (kv_cache_mb), reserved blocks not counted
    blocks_used: int  # held by running sequences
    blocks_cached: int  # held only by the prefix cache (evicted least recently used)
    prefix_cache: bool
    prefix_cache_queries_tokens: int  # prompt tokens looked up (counter)
    prefix_cache_hits_tokens: int  # ... found, so not computed again (counter)
    preemptions: int  # sequences paused and recomputed when the pool ran out (counter)

    @classmethod
    def from_statistics(cls, stats: ModelActorStatistics, *, prefix_cache: bool) -> KVCacheInfo:
        """The one mapping from a model's statistics (the engine's, as its actor last read
        them) to this document's names."""
        return cls(
            block_tokens=BLOCK_TOKENS,
            blocks_total=stats.kv_blocks_total,
            blocks_used=stats.kv_blocks_used,
            blocks_cached=stats.kv_blocks_cached,
            prefix_cache=prefix_cache,
            prefix_cache_queries_tokens=stats.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=stats.prefix_cache_hits_tokens,
            preemptions=stats.preemptions,
        )


class ModelInfo(msgspec.Struct, frozen=True):
    """A model's entry in `/v1/node` (and the answer to a run-time load)."""

    name: str
    state: str  # ModelState
    source: str
    path: str | None
    dtype: str  # as configured ("auto", "float32", …)
    weights: str | None  # what that resolved to on the device, e.g. "cpu-int" (int4/int8)
    tp: int
    max_batch: int
    context: int
    slots_in_use: int
    slots_total: int
    kv_cache: KVCacheInfo
    running: int
    queued: int
    max_queue: int
    ranks: list[RankInfo]
    devices: list[str]
    memory: ModelMemory | None
    loaded_at: float | None  # unix seconds
    steps: int
    step_failures: int
    last_error: str | None
    watchdog: WatchdogStatistics | None


class NodeWatchdog(msgspec.Struct, frozen=True):
    """`/v1/node` `watchdog`: the deadlines, the deadman, and each model's watchdog."""

    step_timeout_s: float
    abort_deadline_s: float
    probe_interval_s: float
    deadman_firing: bool
    deadman_reason: str | None
    models: dict[str, WatchdogStatistics]


class FailpointsInfo(msgspec.Struct, frozen=True):
    configured: dict[str, str]  # name -> action, as NEURON_FAILPOINTS set them
    fired: list[str]


class NodeInfo(msgspec.Struct, frozen=True):
    """The `/v1/node` document (docs/DESIGN.md)."""

    hostname: str
    boot_id: str
    started_at: str
    starts: int
    previous_stop_clean: bool  # False: the process before this one crashed, was killed, exited 70
    status: str
    draining: bool
    config: str  # the config file read, or "<built-in default>"
    gpus: Any  # a live NVML snapshot, or {"available": false, "error": why}
    models: list[ModelInfo]
    generated_tokens_per_s_1m: dict[str, float | None]  # per model; None before two samples
    watchdog: NodeWatchdog
    last_forensics: LastForensics | None
    failpoints: FailpointsInfo
