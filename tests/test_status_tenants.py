"""Issue 47 (#5): `neuron status` shows each tenant's requests, rejections, tokens and queue
time, asking with an operator's key (with `admin_key_file` set, /metrics needs one: a
tenant's key got 401 and status failed)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from neuron_trio.config import config_from_mapping
from neuron_trio.service.metrics.tenant import tenant_metrics
from neuron_trio.status import NodeStatus, api_key, parse_metrics, render

NODE = {
    "hostname": "n",
    "status": "ok",
    "watchdog": {"step_timeout_s": 30, "abort_deadline_s": 60, "probe_interval_s": 30},
    "models": [],
}


def test_render_shows_each_tenant_from_the_metrics_the_node_exports() -> None:
    registry = CollectorRegistry()
    metrics = tenant_metrics(registry)
    for _ in range(3):
        metrics.outcome("alpha", "stop")
    metrics.outcome("alpha", "rejected_queue_full")
    metrics.admitted("alpha", 100, 0.5)
    metrics.admitted("alpha", 20, 1.5)
    metrics.generated("alpha", 400)
    metrics.outcome("beta", "length")
    metrics.admitted("beta", 10, 0.0)
    text = generate_latest(registry).decode()
    status = NodeStatus(node=NODE, metrics=parse_metrics(text))
    screen = render(status, url="http://n", now=0.0)
    lines = screen.splitlines()
    at = lines.index("tenants   2")
    expected = "alpha requests 4 (rejected 1) tokens 120 in, 400 out queue 1.00 s mean"
    assert " ".join(lines[at + 1].split()) == expected
    assert lines[at + 2].split()[:2] == ["beta", "requests"]  # the busiest first


def test_status_asks_with_the_admin_key_when_there_is_one(tmp_path: Path) -> None:
    (tmp_path / "api").write_text("tenant-key\n")
    (tmp_path / "admin").write_text("admin-key\n")
    (tmp_path / "alpha").write_text("alpha-key\n")
    server = {"api_key_file": str(tmp_path / "api")}
    assert api_key(config_from_mapping({"server": server}, origin="t", environ={})) == "tenant-key"
    server["admin_key_file"] = str(tmp_path / "admin")
    config = config_from_mapping({"server": server}, origin="t", environ={})
    assert api_key(config) == "admin-key"
    tenants = [{"name": "alpha", "keys_file": str(tmp_path / "alpha")}]
    config = config_from_mapping({"tenants": tenants}, origin="t", environ={})
    assert api_key(config) == "alpha-key"
