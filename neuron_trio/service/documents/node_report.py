"""What the node says about itself, built from its parts: the health status, the `/v1/node`
document (`service/documents/node_document.py`'s types) and `/metrics`' node statistics.

Plain functions of what `Node` holds (its actors, identity, deadman, failpoints), so that
node.py keeps the registry and the life cycle; the node calls them with its own state.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol

import neuron_trio
from neuron_trio import failpoints as fp
from neuron_trio.config import NeuronConfig
from neuron_trio.service.api import HealthSnapshot, HealthStatus
from neuron_trio.service.documents.node_document import FailpointsInfo, NodeInfo, NodeWatchdog
from neuron_trio.service.metrics.node import NodeStatistics, TokenRates
from neuron_trio.service.model_actor import ModelActor
from neuron_trio.service.model_start import GpuSource
from neuron_trio.service.wedge.deadman import Deadman
from neuron_trio.service.wedge.forensics import LastForensics


def health_status(
    states: Mapping[str, str], *, deadman_firing: bool, draining: bool, serving: bool
) -> HealthStatus:
    """The node's health from its models' states and its own: wedged first, then draining,
    starting (not serving yet), recovering, ok."""
    if deadman_firing or "wedged" in states.values():
        return "wedged"
    if draining:
        return "draining"
    if not serving:
        return "starting"
    if "recovering" in states.values():
        return "recovering"
    return "ok"


async def live_gpus(gpus: GpuSource | None) -> Any:
    """The GPUs' live read as plain values, None without a GPU actor, or why it failed (a live
    NVML read: may take up to its timeout)."""
    if gpus is None:
        return None
    try:
        return (await gpus.live()).to_dict()
    except Exception as exc:
        return {"available": False, "error": f"{type(exc).__name__}: {exc}"}


class NodeParts(Protocol):
    """What the document reads of `Node` (its public parts)."""

    hostname: str
    identity: Any
    config: NeuronConfig
    deadman: Deadman
    failpoints: fp.Failpoints

    @property
    def draining(self) -> bool: ...

    def health(self) -> HealthSnapshot: ...


def node_document(
    node: NodeParts,
    gpus: Any,  # `live_gpus`
    actors: Mapping[str, ModelActor],
    token_rates: TokenRates,
    last_forensics: LastForensics | None,
) -> NodeInfo:
    """The `/v1/node` document of `node`, its `actors` and their rates."""
    health, config, deadman, failpoints = node.health(), node.config, node.deadman, node.failpoints
    deadlines = config.watchdog  # the node's; each model's own are in `models`
    return NodeInfo(
        hostname=node.hostname,
        boot_id=health.boot_id,
        started_at=health.started_at,
        starts=health.starts,
        previous_stop_clean=bool(node.identity.previous_stop_clean),
        status=health.status,
        draining=node.draining,
        config=config.source_path,
        gpus=gpus,
        models=[actor.info() for actor in actors.values()],
        generated_tokens_per_s_1m={name: token_rates.rate(name) for name in actors},
        watchdog=NodeWatchdog(
            step_timeout_s=deadlines.step_timeout_s,
            abort_deadline_s=deadlines.abort_deadline_s,
            probe_interval_s=deadlines.probe_interval_s,
            deadman_firing=deadman.firing,
            deadman_reason=deadman.reason,
            models={
                name: actor.watchdog.statistics()
                for name, actor in actors.items()
                if actor.watchdog is not None
            },
        ),
        last_forensics=last_forensics,
        failpoints=FailpointsInfo(
            configured={k: str(v) for k, v in failpoints.configured.items()},
            fired=list(failpoints.fired),
        ),
    )


def node_statistics(
    *, identity: Any, hostname: str, status: HealthStatus, last_forensics_unix: float | None
) -> NodeStatistics:
    """For `/metrics` (service.metrics.node): identity, health, the last deadman exit."""
    try:
        started = datetime.fromisoformat(str(identity.started_at)).timestamp()
    except ValueError:
        started = 0.0
    return NodeStatistics(
        boot_id=str(identity.boot_id),
        hostname=hostname,
        version=neuron_trio.__version__,
        starts=int(identity.starts),
        started_at_unix=started,
        status=status,
        last_forensics_unix=last_forensics_unix,
        previous_stop_clean=bool(identity.previous_stop_clean),
    )
