"""deploy/grafana/neuron.json: a Grafana dashboard whose every query uses series neuron exports.

The names are checked against the /metrics of the app's real collectors here (a Node with a
fake executor, the GPU collector with one GPU, the HTTP layer's metrics); the slow test in
tests/e2e/test_operator_pack.py checks them again against a real daemon's /metrics and
runs every query in a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from neuron_trio.config import ModelConfig, WatchdogConfig
from neuron_trio.gpu.metrics import GpuCollector
from neuron_trio.gpu.nvml import GpuReading, GpuSnapshot
from neuron_trio.http import create_app
from neuron_trio.service.metrics.watchdog import WatchdogMetrics
from neuron_trio.service.node import Node
from neuron_trio.service.wedge.watchdog import Watchdog
from tests.deploy.promql_names import (
    dashboard_exprs,
    exported_names,
    metric_names,
    recorded_names,
    rules_exprs,
)
from tests.service.fakes import FakeDeadman
from tests.service.node_world import Identity, World, collect, job, make_config, run_world

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "neuron.json"
RULES = DEPLOY / "prometheus" / "neuron.rules.yml"
PROMETHEUS_OWN = {"up"}  # series Prometheus writes itself for every target


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


class OneGpu:
    snapshot = GpuSnapshot(
        available=True,
        gpus=(
            GpuReading(
                index=0,
                uuid="GPU-1",
                name="H100",
                pci_bus_id="0000:01:00.0",
                memory_total_bytes=80 << 30,
                memory_used_bytes=1 << 30,
                memory_free_bytes=79 << 30,
                utilization_gpu_pct=10,
                utilization_memory_pct=5,
                temperature_c=40,
                power_w=100.0,
            ),
        ),
    )


@pytest.fixture(scope="module")
def app_metrics(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The /metrics text of the app's collectors, registered the way the daemon does."""
    tmp_path = tmp_path_factory.mktemp("node")
    found: list[str] = []

    async def test(w: World) -> None:
        config = make_config(tmp_path)

        def watchdog(spec: ModelConfig) -> Watchdog:  # World's, with the node's metrics
            metrics = WatchdogMetrics.for_registry(node.metrics_registry)
            metrics.zero(spec.name)
            return Watchdog(
                model_name=spec.name,
                deadlines=WatchdogConfig(step_timeout_s=30, abort_deadline_s=60),
                deadman=FakeDeadman(),  # type: ignore[arg-type]
                run_thread=w.threads,
                metrics=metrics,
            )

        node = Node(
            config,
            gpus=w.gpus,
            identity=Identity(),
            failpoints=w.failpoints,
            executor_factory=w.factory,
            estimator=w.estimator,
            watchdog_factory=watchdog,
            burst_gap_s=0.0,  # a MockClock moved by hand: step at once
        )
        node.metrics_registry.register(GpuCollector(OneGpu()))  # as daemon._start does
        create_app(node, config)  # registers the HTTP layer's collectors
        await w.nursery.start(node.run)
        node.mark_serving()
        await collect(node, job())
        found.append(generate_latest(node.metrics_registry).decode())

    run_world(tmp_path, test)
    return found[0]


def test_metric_name_extraction() -> None:
    assert metric_names(
        'histogram_quantile(0.99, sum by (model, le) (rate(a_bucket{x=~"$m"}[5m]))) / b > 0.5'
    ) == {"a_bucket", "b"}
    assert metric_names("max_over_time(c[10m]) - min_over_time(c[10m]) >= 2 and time() - d") == {
        "c",
        "d",
    }
    assert metric_names('x == 1 unless on (job) y{a="b"} offset 5m') == {"x", "y"}


def test_every_dashboard_query_uses_exported_metrics(app_metrics: str) -> None:
    exported = exported_names(app_metrics) | PROMETHEUS_OWN
    queries = list(dashboard_exprs(dashboard()))
    assert len(queries) > 30
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= exported, f"{where}: {sorted(names - exported)} not in /metrics"


def test_every_rule_uses_exported_metrics(app_metrics: str) -> None:
    rules = yaml.safe_load(RULES.read_text())
    exported = exported_names(app_metrics) | PROMETHEUS_OWN | recorded_names(rules)
    for name, expr in rules_exprs(rules):
        names = metric_names(expr)
        assert names, f"{name}: no metric in {expr!r}"
        assert names <= exported, f"{name}: {sorted(names - exported)} not in /metrics"


def test_the_check_catches_a_misspelt_metric(app_metrics: str) -> None:
    exported = exported_names(app_metrics)
    assert "neuron_model_queue_depth" in exported
    assert "neuron_model_time_to_first_token_seconds_bucket" in exported
    assert "neuron_watchdog_wedges_total" in exported
    assert not metric_names("rate(neuron_model_queue_dept[5m])") <= exported


def test_the_dashboard_has_a_prometheus_datasource_variable() -> None:
    doc = dashboard()
    [ds] = [v for v in doc["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    ref = {"type": "prometheus", "uid": f"${{{ds['name']}}}"}
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    for panel in panels:
        assert panel["datasource"] == ref, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == ref, panel["title"]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"] == ref, var["name"]


def test_panels_cover_the_operator_questions_and_do_not_overlap() -> None:
    doc = dashboard()
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in doc["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    used = {n for p in panels for t in p["targets"] for n in metric_names(t["expr"])}
    for needed in (
        "neuron_http_requests_total",
        "neuron_model_requests_total",
        "neuron_model_time_to_first_token_seconds_bucket",
        "neuron_model_time_per_output_token_seconds_bucket",
        "neuron_model_generated_tokens_total",
        "neuron_model_queue_depth",
        "neuron_model_kv_slots_in_use",
        "neuron_model_kv_blocks_used",
        "neuron_model_prefix_cache_hits_tokens_total",
        "neuron_watchdog_wedges_total",
        "neuron_watchdog_aborts_total",
        "neuron_watchdog_recoveries_total",
        "neuron_watchdog_idle_probes_total",
        "neuron_gpu_memory_used_bytes",
        "neuron_gpu_utilization_ratio",
        "neuron_node_starts_total",
    ):
        assert needed in used, needed
