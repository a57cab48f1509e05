"""The `/v1/node` document (docs/DESIGN.md): every type of it in one module.

`Node.node_info()` builds a `NodeInfo`; each model's entry is its actor's `ModelInfo`, which
embeds the rank shapes (`RankInfo`), the watchdog's own statistics (`WatchdogStatistics`) and
the last forensics report (`LastForensics`) as they are, so a field is defined once; its
`kv_cache` is the engine's statistics (`EngineStatistics`) under the document's names, mapped in
one place (`KVCacheInfo.from_statistics`). `neuron status` decodes the same types.

Every field has a default: msgspec's rule for a schema that changes over time, so that
`neuron status` of one version reads a node of another (a field it does not know is ignored,
one the node does not send takes its default). The node always writes every field.

For a caller that is not an operator, the HTTP layer hides some values (`http/tenancy.py`):
paths, the last error and the last forensics report become a "hidden" string, the prefix
cache's counters null. The types admit those values too.
"""

from __future__ import annotations

from typing import Any

import msgspec

from neuron_trio.executor.api import BLOCK_TOKENS, EngineStatistics, RankInfo
from neuron_trio.service.wedge.forensics import LastForensics
from neuron_trio.service.wedge.records import WatchdogStatistics

__all__ = [
    "FailpointsInfo",
    "KVCacheInfo",
    "LastForensics",
    "ModelInfo",
    "ModelMemory",
    "NodeInfo",
    "NodeWatchdog",
    "RankInfo",
    "SpeculationInfo",
    "WatchdogStatistics",
]


class ModelMemory(msgspec.Struct, frozen=True, kw_only=True):
    """What placement estimated for a model, and the devices it chose (`/v1/node`)."""

    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    total_bytes: int = 0
    devices: list[str] = []


class KVCacheInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A model's paged KV cache in `/v1/node`: blocks of `block_tokens` tokens."""

    block_tokens: int = BLOCK_TOKENS
    blocks_total: int = 0  # the pool (kv_cache_mb), reserved blocks not counted
    blocks_used: int = 0  # held by running sequences
    blocks_cached: int = 0  # held only by the prefix cache (evicted least recently used)
    prefix_cache: bool = False
    # None when the caller is not an operator (a tenant could read another's hits from them)
    prefix_cache_queries_tokens: int | None = 0  # prompt tokens looked up (counter)
    prefix_cache_hits_tokens: int | None = 0  # ... found, so not computed again (counter)
    preemptions: int = 0  # sequences paused and recomputed when the pool ran out (counter)

    @classmethod
    def from_statistics(cls, engine: EngineStatistics, *, prefix_cache: bool) -> KVCacheInfo:
        """The one mapping from the engine's statistics (as its actor last read them) to this
        document's names."""
        return cls(
            block_tokens=BLOCK_TOKENS,
            blocks_total=engine.kv_blocks_total,
            blocks_used=engine.kv_blocks_used,
            blocks_cached=engine.kv_blocks_cached,
            prefix_cache=prefix_cache,
            prefix_cache_queries_tokens=engine.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=engine.prefix_cache_hits_tokens,
            preemptions=engine.preemptions,
        )


class SpeculationInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A model's speculative decoding in `/v1/node` ([default_models.speculative])."""

    method: str = "ngram"
    num_tokens: int = 0  # the most tokens a draft has
    proposed_tokens: int = 0  # draft tokens verified (counter)
    accepted_tokens: int = 0  # ... kept (counter)
    acceptance_rate: float | None = None  # accepted / proposed; None before any draft

    @classmethod
    def from_statistics(
        cls, engine: EngineStatistics, method: str, num_tokens: int
    ) -> SpeculationInfo:
        proposed, accepted = engine.speculative_proposed_tokens, engine.speculative_accepted_tokens
        return cls(
            method=method,
            num_tokens=num_tokens,
            proposed_tokens=proposed,
            accepted_tokens=accepted,
            acceptance_rate=round(accepted / proposed, 4) if proposed else None,
        )


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A model's entry in `/v1/node` (and the answer to a run-time load)."""

    name: str = ""
    state: str = ""  # ModelState
    source: str = ""
    path: str | None = None
    dtype: str = ""  # as configured ("auto", "float32", …)
    weights: str | None = None  # what that resolved to on the device, e.g. "cpu-int" (int4/int8)
    tp: int = 1
    max_batch: int = 0
    context: int = 0
    slots_in_use: int = 0
    slots_total: int = 0
    kv_cache: KVCacheInfo | None = None  # None from a node older than the paged KV cache
    speculative: SpeculationInfo | None = None  # None: speculation off
    running: int = 0
    queued: int = 0
    max_queue: int = 0
    ranks: list[RankInfo] = []
    devices: list[str] = []
    memory: ModelMemory | None = None
    loaded_at: float | None = None  # unix seconds
    steps: int = 0
    step_failures: int = 0
    last_error: str | None = None
    watchdog: WatchdogStatistics | None = None


class NodeWatchdog(msgspec.Struct, frozen=True, kw_only=True):
    """`/v1/node` `watchdog`: the deadlines, the deadman, and each model's watchdog."""

    step_timeout_s: float = 0.0
    abort_deadline_s: float = 0.0
    probe_interval_s: float = 0.0
    deadman_firing: bool = False
    deadman_reason: str | None = None
    models: dict[str, WatchdogStatistics] = {}


class FailpointsInfo(msgspec.Struct, frozen=True, kw_only=True):
    configured: dict[str, str] = {}  # name -> action, as NEURON_FAILPOINTS set them
    fired: list[str] = []


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The `/v1/node` document (docs/DESIGN.md)."""

    hostname: str = ""
    boot_id: str = ""
    started_at: str = ""
    starts: int = 0
    previous_stop_clean: bool = (
        True  # False: the process before this one crashed, was killed, exited 70
    )
    status: str = ""
    draining: bool = False
    config: str = ""  # the config file read, or "<built-in default>"
    gpus: Any = None  # a live NVML snapshot, or {"available": false, "error": why}
    models: list[ModelInfo] = []
    generated_tokens_per_s_1m: dict[str, float | None] = {}  # per model; None before two samples
    watchdog: NodeWatchdog = NodeWatchdog()
    # a string (hidden) when the caller is not an operator
    last_forensics: LastForensics | str | None = None
    failpoints: FailpointsInfo = FailpointsInfo()
