"""Issue 47 (#5): requests, tokens, queue time and rejections by tenant name in /metrics.

Before, every series was by model only: an operator could not tell which team used the node
or was refused. The label set is bounded (MAX_TENANT_LABELS, then OTHER_LABEL)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from neuron_trio.errors import QueueFullError, RequestError
from neuron_trio.service.metrics.tenant import (
    MAX_TENANT_LABELS,
    NO_TENANT_LABEL,
    OTHER_LABEL,
    tenant_metrics,
)
from tests.service.actor_harness import Harness, job, run_actor, settle


def test_each_tenants_requests_tokens_and_queue_time_are_counted() -> None:
    async def test(h: Harness) -> None:
        alpha = h.consume(job("hello", max_tokens=3, tenant="alpha"))
        beta = h.consume(job("hi", max_tokens=2, tenant="beta"))
        anonymous = h.consume(job("x", max_tokens=1))
        await settle()
        assert all(r["done"] and r["error"] is None for r in (alpha, beta, anonymous))

        def value(name: str, **labels: str) -> float | None:
            return h.registry.get_sample_value(name, labels)

        assert value("neuron_tenant_requests_total", tenant="alpha", outcome="length") == 1
        assert value("neuron_tenant_prompt_tokens_total", tenant="alpha") == 5
        assert value("neuron_tenant_completion_tokens_total", tenant="alpha") == 3
        assert value("neuron_tenant_prompt_tokens_total", tenant="beta") == 2
        assert value("neuron_tenant_completion_tokens_total", tenant="beta") == 2
        assert value("neuron_tenant_queue_time_seconds_count", tenant="beta") == 1
        assert value("neuron_tenant_completion_tokens_total", tenant=NO_TENANT_LABEL) == 1
        text = generate_latest(h.registry).decode()
        assert "key" not in text.split("neuron_tenant_")[1]  # names only

    run_actor(test, max_batch=4)


def test_the_label_set_is_bounded_and_rejections_have_their_own_series() -> None:
    registry = CollectorRegistry()
    metrics = tenant_metrics(registry)
    assert tenant_metrics(registry) is metrics  # registered once
    for i in range(MAX_TENANT_LABELS + 50):
        metrics.outcome(f"t{i}", "rejected_queue_full")
    assert metrics.label("t0") == "t0"
    assert metrics.label("t-new") == OTHER_LABEL
    assert metrics.label(None) == NO_TENANT_LABEL
    rejected = registry.get_sample_value(
        "neuron_tenant_rejections_total", {"tenant": OTHER_LABEL, "reason": "queue_full"}
    )
    assert rejected == 50
    tenants = {
        s.labels["tenant"]
        for family in registry.collect()
        for s in family.samples
        if s.name == "neuron_tenant_requests_total"
    }
    assert len(tenants) == MAX_TENANT_LABELS + 1


def test_a_tenants_rejections_are_counted_under_its_name() -> None:
    async def test(h: Harness) -> None:
        h.threads.hold()  # the first step blocks: the one slot stays busy
        running = h.consume(job(tenant="alpha"))
        await settle()
        with pytest.raises(QueueFullError):  # max_queue 0: a 429
            async with h.actor.generate(job(tenant="beta")):
                pass
        with pytest.raises(RequestError):  # an empty prompt: a 400
            async with h.actor.generate(job(prompt="", tenant="beta")):
                pass
        h.threads.release()
        await settle()
        assert running["done"] and running["error"] is None

        def rejected(reason: str) -> float | None:
            labels = {"tenant": "beta", "reason": reason}
            return h.registry.get_sample_value("neuron_tenant_rejections_total", labels)

        assert rejected("queue_full") == 1
        assert rejected("invalid") == 1

    run_actor(test, max_batch=1, max_queue=0)
