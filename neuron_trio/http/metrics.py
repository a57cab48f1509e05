"""The HTTP layer's Prometheus collectors, registered on the node's registry."""

from __future__ import annotations

import platform
import weakref
from dataclasses import dataclass
from importlib import metadata

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import neuron_trio

__all__ = ["KNOWN_METHODS", "HttpMetrics", "http_metrics", "method_label"]

# A client may send any token as its method: each new value would be a new series, for ever
# (10,000 made-up methods grew /metrics from 28 KB to 24 MB). Others count as "other".
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in KNOWN_METHODS else "other"


# Seconds. Covers a /health answer (sub-ms) up to a long non-streaming generation.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


@dataclass(frozen=True)
class HttpMetrics:
    requests: Counter
    latency: Histogram
    in_flight: Gauge

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        code = str(status)
        method = method_label(method)
        self.requests.labels(route=route, method=method, status=code).inc()
        self.latency.labels(route=route, method=method, status=code).observe(seconds)


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, HttpMetrics] = (
    weakref.WeakKeyDictionary()
)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def http_metrics(registry: CollectorRegistry) -> HttpMetrics:
    """The HTTP collectors on `registry`, registered once per registry (create_app may run twice)."""
    found = _BY_REGISTRY.get(registry)
    if found is not None:
        return found
    metrics = HttpMetrics(
        requests=Counter(
            "neuron_http_requests",
            "HTTP requests answered, by route template, method and status.",
            ["route", "method", "status"],
            registry=registry,
        ),
        latency=Histogram(
            "neuron_http_request_duration_seconds",
            "Time from request to the end of its response (streams: to the last event).",
            ["route", "method", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        ),
        in_flight=Gauge(
            "neuron_http_requests_in_flight",
            "HTTP requests being answered now (open streams included).",
            registry=registry,
        ),
    )
    build = Gauge(
        "neuron_build_info",
        "Versions of neuron and its serving stack (value 1).",
        ["version", "python", "hypercorn", "starlette"],
        registry=None,
    )
    build.labels(
        version=neuron_trio.__version__,
        python=platform.python_version(),
        hypercorn=_version("hypercorn"),
        starlette=_version("starlette"),
    ).set(1)
    try:
        registry.register(build)
    except ValueError:
        pass  # the node already exports a build info of its own
    _BY_REGISTRY[registry] = metrics
    return metrics
