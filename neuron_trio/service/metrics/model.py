"""Per-model Prometheus metrics: request outcomes, latency histograms, token counters, gauges.

Counters and histograms are updated by the model actors as requests finish. Gauges (queue
depth, running sequences, KV slots, state) are read from the actors' `statistics()` at scrape
time by a custom collector, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from neuron_trio.executor.api import BLOCK_TOKENS, EngineStatistics
from neuron_trio.service.metrics.tenant import tenant_metrics
from neuron_trio.service.model_state import MODEL_STATES

# Outcomes of a request (label `outcome` of neuron_model_requests_total).
OUTCOMES = (
    "stop",  # finished: EOS, end-of-turn or a stop string
    "length",  # finished: max_tokens
    "tool_calls",  # finished: the answer is a call to one of the request's tools
    "cancelled",  # the client left before the end
    "error",  # the engine reported an error for the sequence
    "unavailable",  # failed in flight: the model wedged, recovered or was stopped
    "rejected_invalid",  # 400 before queueing (prompt too long, bad parameters)
    "rejected_queue_full",  # 429
    "rejected_unavailable",  # 503 before queueing: draining, recovering, unloading
)

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.5, float("inf"))


@dataclass(frozen=True)
class ModelActorStatistics:
    """A model actor's state for /metrics and /v1/node (cheap: no engine call): the actor's own
    figures, and the engine's statistics as the actor last read them (between steps)."""

    name: str
    state: str
    queued: int
    running: int
    slots_total: int  # max_batch
    steps: int
    failures: int  # steps or probes that failed or wedged (the watchdog counts wedges)
    engine: EngineStatistics  # slots, the paged KV cache and the prefix cache; zeros until loaded

    @property
    def kv_cache_usage(self) -> float:
        """The fraction 0..1 of KV blocks held by running sequences (vLLM's
        `kv_cache_usage_perc`: blocks only the prefix cache holds count as free)."""
        if self.engine.kv_blocks_total <= 0:
            return 0.0
        return min(1.0, self.engine.kv_blocks_used / self.engine.kv_blocks_total)


class NodeMetrics:
    """The model metrics of one node, registered in its CollectorRegistry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        statistics: Callable[[], Iterable[ModelActorStatistics]],
    ) -> None:
        self.requests = Counter(
            "neuron_model_requests",
            "Generation requests by outcome",
            ["model", "outcome"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "neuron_model_time_to_first_token_seconds",
            "From queueing a request to its first generated token",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "neuron_model_time_per_output_token_seconds",
            "Mean time per generated token after the first, per request",
            ["model"],
            buckets=_TPOT_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "neuron_model_prompt_tokens", "Prompt tokens admitted", ["model"], registry=registry
        )
        self.generated_tokens = Counter(
            "neuron_model_generated_tokens", "Tokens generated", ["model"], registry=registry
        )
        registry.register(_ActorCollector(statistics))
        self.tenants = tenant_metrics(registry)  # the same requests, by tenant (issue 47)

    def for_model(self, name: str) -> ModelMetrics:
        return ModelMetrics(self, name)


class ModelMetrics:
    """The metrics of one model, labels bound."""

    def __init__(self, node: NodeMetrics, name: str) -> None:
        self.name = name
        self.tenants = node.tenants
        self._requests = {o: node.requests.labels(name, o) for o in OUTCOMES}
        self._ttft = node.time_to_first_token.labels(name)
        self._tpot = node.time_per_output_token.labels(name)
        self._prompt = node.prompt_tokens.labels(name)
        self._generated = node.generated_tokens.labels(name)

    def outcome(self, outcome: str) -> None:
        counter = self._requests.get(outcome) or self._requests["error"]
        counter.inc()

    def admitted(self, prompt_tokens: int) -> None:
        self._prompt.inc(prompt_tokens)

    def generated(self, tokens: int) -> None:
        if tokens:
            self._generated.inc(tokens)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(max(seconds, 0.0))

    def per_output_token(self, seconds: float) -> None:
        self._tpot.observe(max(seconds, 0.0))


_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
# The series with one label (the model): kind, name, help, and how to read it.
_PER_MODEL: tuple[tuple[_Family, str, str, Callable[[ModelActorStatistics], float]], ...] = (
    (GaugeMetricFamily, "neuron_model_queue_depth", "Requests waiting for a slot",
     lambda s: s.queued),
    (GaugeMetricFamily, "neuron_model_running_sequences", "Sequences in engine slots",
     lambda s: s.running),
    (GaugeMetricFamily, "neuron_model_kv_slots_in_use", "KV cache slots in use",
     lambda s: s.engine.slots_in_use),
    (GaugeMetricFamily, "neuron_model_kv_slots", "KV cache slots (max_batch)",
     lambda s: s.slots_total),
    (CounterMetricFamily, "neuron_model_steps", "Engine steps run", lambda s: s.steps),
    (CounterMetricFamily, "neuron_model_step_failures",
     "Steps or probes that failed or wedged (their requests got 503)", lambda s: s.failures),
    (GaugeMetricFamily, "neuron_model_kv_blocks_used",
     "KV cache blocks (16 tokens) held by running sequences",
     lambda s: s.engine.kv_blocks_used),
    (GaugeMetricFamily, "neuron_model_kv_blocks_cached",
     "KV cache blocks held only by the prefix cache (evicted when needed)",
     lambda s: s.engine.kv_blocks_cached),
    (GaugeMetricFamily, "neuron_model_kv_blocks", "KV cache blocks (16 tokens) in the pool",
     lambda s: s.engine.kv_blocks_total),
    (CounterMetricFamily, "neuron_model_prefix_cache_queries_tokens",
     "Prompt tokens looked up in the prefix cache",
     lambda s: s.engine.prefix_cache_queries_tokens),
    (CounterMetricFamily, "neuron_model_prefix_cache_hits_tokens",
     "Prompt tokens found in the prefix cache (not computed again)",
     lambda s: s.engine.prefix_cache_hits_tokens),
    (GaugeMetricFamily, "neuron_model_kv_cache_usage_ratio",
     "Fraction (0..1) of KV cache blocks held by running sequences",
     lambda s: s.kv_cache_usage),
    (CounterMetricFamily, "neuron_model_preemptions",
     "Sequences paused and recomputed later: the KV cache ran out, or a lighter tenant took the slot",
     lambda s: s.engine.preemptions),
    (CounterMetricFamily, "neuron_model_speculative_proposed_tokens",
     "Draft tokens verified by speculative decoding",
     lambda s: s.engine.speculative_proposed_tokens),
    (CounterMetricFamily, "neuron_model_speculative_accepted_tokens",
     "Draft tokens the model agreed with (kept) in speculative decoding",
     lambda s: s.engine.speculative_accepted_tokens),
)  # fmt: skip


class _ActorCollector(Collector):
    def __init__(self, statistics: Callable[[], Iterable[ModelActorStatistics]]) -> None:
        self._statistics = statistics

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic: no duplicate-name check at registration

    def collect(self) -> Iterator[Metric]:
        stats = list(self._statistics())
        for family, name, documentation, value in _PER_MODEL:
            metric = family(name, documentation, labels=["model"])
            for s in stats:
                metric.add_metric([s.name], value(s))
            yield metric
        state = GaugeMetricFamily(
            "neuron_model_state", "1 for the model's current state", labels=["model", "state"]
        )
        # The Gateway API Inference Extension's model-server protocol (README, "Routers"): the
        # cache's shape as labels its picker reads (and the usage ratio, in _PER_MODEL).
        cache_info = GaugeMetricFamily(
            "neuron_model_kv_cache_config_info",
            "The KV cache's shape: tokens a block (block_size) and blocks (num_gpu_blocks)",
            labels=["model", "block_size", "num_gpu_blocks"],
        )
        for s in stats:
            for st in MODEL_STATES:
                state.add_metric([s.name, st], 1.0 if s.state == st else 0.0)
            blocks = str(s.engine.kv_blocks_total)
            cache_info.add_metric([s.name, str(BLOCK_TOKENS), blocks], 1.0)
        yield from (state, cache_info)
