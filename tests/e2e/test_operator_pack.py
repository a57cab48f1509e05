"""The operator pack against the real thing: a `neuron serve` subprocess (built-in model,
tp = 1, CPU, `engine.step=hang` armed) scraped by a real Prometheus on 127.0.0.1 with
deploy/prometheus/neuron.rules.yml loaded, 1 s scrape and evaluation intervals.

In order, on one daemon (a wedge is the last thing it does):
1. the dashboard's and the rules' metric names are on the daemon's /metrics;
2. `neuron status` (human, --json, with the config's API key) says it serves, exit 0;
3. Prometheus: the target is up, every rule evaluates without error, every dashboard query
   runs; then a completion wedges the step and NeuronWedged goes pending, while
   `neuron status` exits 69.

Bounded: the start of the daemon (as the drills), then about 15 s. Prometheus comes from
Debian's `prometheus` package: skipped without it, failed in CI (.ci/run installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.promql_names import (
    dashboard_exprs,
    exported_names,
    metric_names,
    recorded_names,
    rules_exprs,
    with_grafana_variables,
)
from tests.neuron_process import BUSY_READY_S, free_port, run_neuron, spawn_neuron, write_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "neuron.rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "neuron.json"
MODEL = "pack"
KEY = "operator-pack-key"
STEP_S = 3.0  # the wedge is detected 3 s after the hung step starts
ABORT_S = 40.0  # tp = 1: the model stays "recovering" this long, then exit 70 (after the test)
PROMETHEUS_S = 30.0  # Prometheus up, target scraped, rules evaluated; the wedge seen


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is missing in CI (.ci/run installs Debian's prometheus)")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return found


def wait_for(what: str, cond: Callable[[], Any], timeout_s: float, log: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not {what} within {timeout_s:g} s\n{log()}")


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    base: str
    config: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def status(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_neuron("status", "--config", str(self.config), *args, timeout=60)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("pack")
    port = free_port()
    key_file = tmp / "api-key"
    key_file.write_text(KEY + "\n")
    config = write_config(
        tmp / "neuron.toml",
        server={"listen": [f"127.0.0.1:{port}"], "api_key_file": key_file},
        node={"state_dir": tmp / "state"},
        tp={"step_timeout_s": STEP_S, "abort_deadline_s": ABORT_S, "probe_interval_s": 3600},
        models=[
            {
                "name": MODEL,
                "source": "builtin:smollm2-135m",
                "tp": 1,
                "devices": "cpu",
                "max_batch": 2,
                "context": 512,
            }
        ],
    )
    log_path = tmp / "neuron.log"
    proc = spawn_neuron(config, log_path, {"NEURON_FAILPOINTS": "engine.step=hang"})
    node = Node(proc, f"http://127.0.0.1:{port}", config, log_path)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"neuron exited {proc.returncode} on start\n{node.log()}")
        try:
            return httpx.get(node.base + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("ready (/health 200)", ready, BUSY_READY_S, node.log)
        yield node
    finally:
        proc.kill()
        proc.wait(10)


def test_dashboard_and_rules_use_the_real_metrics(node: Node) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}  # with api_key_file set, /metrics needs a key
    text = httpx.get(node.base + "/metrics", headers=auth, timeout=10).text
    exported = exported_names(text) | {"up"}
    rules = yaml.safe_load(RULES.read_text())
    queries = [*dashboard_exprs(json.loads(DASHBOARD.read_text())), *rules_exprs(rules)]
    for where, expr in queries:
        missing = metric_names(expr) - exported - recorded_names(rules)
        assert not missing, f"{where}: {sorted(missing)} not on the daemon's /metrics"


def test_status_of_the_serving_daemon(node: Node) -> None:
    health = httpx.get(node.base + "/health", timeout=10).json()
    human = node.status()
    assert human.returncode == 0, human.stdout + human.stderr
    assert "SERVING" in human.stdout and "NOT SERVING" not in human.stdout
    assert f"boot      {health['boot_id']}, start 1 in this state dir" in human.stdout
    assert f"  {MODEL}" in human.stdout and "slots 0/2" in human.stdout
    assert 'FAILPOINTS {"engine.step": "hang"}, fired []' in human.stdout
    as_json = node.status("--json")
    assert as_json.returncode == 0
    doc = json.loads(as_json.stdout)
    assert doc["serving"] is True and doc["node"]["boot_id"] == health["boot_id"]


@dataclass
class Prometheus:
    proc: subprocess.Popen[bytes]
    base: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def api(self, path: str, **params: str) -> Any:
        r = httpx.get(self.base + path, params=params, timeout=5)
        r.raise_for_status()
        return r.json()["data"]


@pytest.fixture
def prometheus(node: Node, tmp_path: Path) -> Iterator[Prometheus]:
    binary = prometheus_binary()
    port = free_port()
    target = node.base.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: neuron
    authorization: {{credentials: "{KEY}"}}  # with api_key_file set, /metrics needs a key
    static_configs: [{{targets: ["{target}"]}}]
"""
    )
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield Prometheus(proc, f"http://127.0.0.1:{port}", log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_prometheus_scrapes_evaluates_and_sees_the_wedge(
    node: Node, prometheus: Prometheus
) -> None:
    prom = prometheus

    def logs() -> str:
        return f"--- prometheus\n{prom.log()}\n--- neuron\n{node.log()}"

    def target_up() -> bool:
        try:
            targets = prom.api("/api/v1/targets")["activeTargets"]
        except httpx.HTTPError:
            return False
        return bool(targets) and all(t["health"] == "up" for t in targets)

    wait_for("the target up", target_up, PROMETHEUS_S, logs)

    def rules_evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in prom.api("/api/v1/rules")["groups"] for r in g["rules"]]
        done = all(r.get("lastEvaluation", "").startswith("20") for r in rules)
        return rules if rules and done and all(r["health"] != "unknown" for r in rules) else None

    rules = wait_for("every rule evaluated", rules_evaluated, PROMETHEUS_S, logs)
    expected = {r.get("alert") or r["record"] for _, r in _rules()}
    assert {r["name"] for r in rules} == expected
    errors = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not errors, errors
    assert float(prom.api("/api/v1/query", query='up{job="neuron"}')["result"][0]["value"][1]) == 1

    for where, expr in dashboard_exprs(json.loads(DASHBOARD.read_text())):
        r = httpx.get(
            prom.base + "/api/v1/query", params={"query": with_grafana_variables(expr)}, timeout=5
        )
        assert r.status_code == 200, f"{where}: {expr}: {r.text}"

    # The wedge: the armed engine.step=hang blocks the first step of this completion.
    threading.Thread(target=_complete, args=(node.base,), name="wedge", daemon=True).start()

    def wedge_alert() -> str | None:
        for alert in prom.api("/api/v1/alerts")["alerts"]:
            if alert["labels"]["alertname"] == "NeuronWedged":
                assert alert["labels"]["model"] == MODEL
                return str(alert["state"])
        return None

    assert wait_for("NeuronWedged pending", wedge_alert, STEP_S + PROMETHEUS_S, logs) == "pending"
    status = node.status()
    assert status.returncode == 69, status.stdout + status.stderr
    assert "NOT SERVING (recovering)" in status.stdout or "NOT SERVING (wedged)" in status.stdout
    assert "wedges 1" in status.stdout and 'fired ["engine.step"]' in status.stdout


def _rules() -> list[tuple[str, dict[str, Any]]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(g["name"], r) for g in doc["groups"] for r in g["rules"]]


def _complete(base: str) -> None:
    try:
        httpx.post(
            base + "/v1/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4},
            timeout=STEP_S + ABORT_S + 10,
        )
    except httpx.HTTPError:
        pass  # the step is wedged on purpose: the answer is a 503 or nothing
