"""How loaded a node (or one of its models) is, in the few figures a router weighs it by.

The same figures go out three ways, so that whichever a router reads agrees with the others:
`/health`'s `load` object, the ORCA `endpoint-load-metrics` response header
(`http/orca.py`), and the model-server-protocol gauges of `/metrics` (`model_metrics.py`).
Names follow vLLM's (`num_requests_waiting`, `num_requests_running`, `kv_cache_usage_perc`,
the last a fraction 0..1 despite its name), as the endpoint pickers and ORCA consumers that
know vLLM expect.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from neuron_trio.service.metrics.model import ModelActorStatistics


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    num_requests_waiting: int  # queued for a slot
    num_requests_running: int  # in engine slots
    kv_cache_usage_perc: float  # fraction 0..1 of KV blocks held by running sequences
    # ORCA's application_utilization: how full the model is, max(slots in use / slots, KV
    # usage), plus the queue in slots' worth (so above 1.0 when requests wait: ORCA's "usage
    # past the soft limit"). A weighted round robin sends less where it is higher.
    application_utilization: float


IDLE = LoadReport(
    num_requests_waiting=0, num_requests_running=0, kv_cache_usage_perc=0.0,
    application_utilization=0.0,
)  # fmt: skip


def model_load(stats: ModelActorStatistics) -> LoadReport:
    slots = max(1, stats.slots_total)
    busy = max(stats.engine.slots_in_use / slots, stats.kv_cache_usage)
    return LoadReport(
        num_requests_waiting=stats.queued,
        num_requests_running=stats.running,
        kv_cache_usage_perc=round(stats.kv_cache_usage, 4),
        application_utilization=round(busy + stats.queued / slots, 4),
    )


def node_load(models: Iterable[ModelActorStatistics]) -> LoadReport:
    """The node as a whole: requests summed, usage and utilization of its fullest model (a
    request may be for that one)."""
    reports = [model_load(stats) for stats in models]
    if not reports:
        return IDLE
    return LoadReport(
        num_requests_waiting=sum(r.num_requests_waiting for r in reports),
        num_requests_running=sum(r.num_requests_running for r in reports),
        kv_cache_usage_perc=max(r.kv_cache_usage_perc for r in reports),
        application_utilization=max(r.application_utilization for r in reports),
    )
