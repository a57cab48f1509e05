"""Per-tenant Prometheus metrics: requests, tokens, queue time and rejections by tenant name.

Issue 47 (#5): an operator sharing a node between teams sees who uses it and who is refused.
A tenant's name (http/tenancy.py) is the only label: never a key. The names that reach the
service come from the configuration (a `[[tenants]]` entry, one per key of `api_key_file`,
"operator"), checked by the middleware, so the label set is the configured one; as a second
bound, past MAX_TENANT_LABELS distinct names the rest count under OTHER_LABEL, and requests
without a tenant (no key configured) under NO_TENANT_LABEL. Neither can be a tenant's name
(config.TenantName starts with a letter or digit).

Counted by the model actors (service/requests/request_table.py) as each event happens, over all
models: a tenant's figures are the node's, whichever model served them.
"""

from __future__ import annotations

import threading
import weakref

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = [
    "MAX_TENANT_LABELS",
    "NO_TENANT_LABEL",
    "OTHER_LABEL",
    "TenantMetrics",
    "tenant_metrics",
]

MAX_TENANT_LABELS = 256
NO_TENANT_LABEL = "_none"
OTHER_LABEL = "_other"
REJECTED_PREFIX = "rejected_"

# Seconds from queueing to admission: a free slot at once (sub-ms) to a long wait behind
# other tenants' streams.
_QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, float("inf"))


class TenantMetrics:
    """The per-tenant series of one registry (`tenant_metrics(registry)`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._names: set[str] = set()
        self._lock = threading.Lock()  # labels may be asked for from worker threads
        self.requests = Counter(
            "neuron_tenant_requests",
            "Generation requests by tenant and outcome (rejected_* included)",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.rejections = Counter(
            "neuron_tenant_rejections",
            "Requests refused before they ran, by tenant and reason (429, 400, 503)",
            ["tenant", "reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "neuron_tenant_prompt_tokens",
            "Prompt tokens admitted, by tenant",
            ["tenant"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "neuron_tenant_completion_tokens",
            "Tokens generated, by tenant",
            ["tenant"],
            registry=registry,
        )
        self.queue_time = Histogram(
            "neuron_tenant_queue_time_seconds",
            "From queueing a request to its admission into the engine, by tenant",
            ["tenant"],
            buckets=_QUEUE_BUCKETS,
            registry=registry,
        )

    def label(self, tenant: str | None) -> str:
        """The label of `tenant`: its name while the label set has room, else OTHER_LABEL."""
        if tenant is None:
            return NO_TENANT_LABEL
        with self._lock:
            if tenant in self._names:
                return tenant
            if len(self._names) < MAX_TENANT_LABELS:
                self._names.add(tenant)
                return tenant
        return OTHER_LABEL

    def outcome(self, tenant: str | None, outcome: str) -> None:
        label = self.label(tenant)
        self.requests.labels(label, outcome).inc()
        if outcome.startswith(REJECTED_PREFIX):
            self.rejections.labels(label, outcome.removeprefix(REJECTED_PREFIX)).inc()

    def admitted(self, tenant: str | None, prompt_tokens: int, queued_s: float) -> None:
        label = self.label(tenant)
        self.prompt_tokens.labels(label).inc(prompt_tokens)
        self.queue_time.labels(label).observe(max(queued_s, 0.0))

    def generated(self, tenant: str | None, tokens: int) -> None:
        if tokens:
            self.completion_tokens.labels(self.label(tenant)).inc(tokens)


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, TenantMetrics] = (
    weakref.WeakKeyDictionary()
)


def tenant_metrics(registry: CollectorRegistry) -> TenantMetrics:
    """The tenant series on `registry`, registered once per registry."""
    found = _BY_REGISTRY.get(registry)
    if found is None:
        found = _BY_REGISTRY[registry] = TenantMetrics(registry)
    return found
