"""deploy/prometheus: the rules pass `promtool check rules` and their unit tests
(`promtool test rules`), and every alert has a test where it fires and one where it does not.

promtool comes with Debian's `prometheus` package (.ci/run installs it). Without it these
tests skip on a workstation and fail in CI (CI=true).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS / "neuron.rules.yml"
RULE_TESTS = PROMETHEUS / "neuron.rules.test.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing in CI (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def run_promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def alerts(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules() -> None:
    proc = run_promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_test_rules() -> None:
    proc = run_promtool("test", "rules", RULE_TESTS.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_test_rules_can_fail(tmp_path: Path) -> None:
    """Control: the unit tests catch a changed threshold (so the SUCCESS above means something)."""
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    broken = RULES.read_text().replace("neuron_gpu_memory_total_bytes > 0.95", "x > 0.5")
    assert broken != RULES.read_text()
    (tmp_path / RULES.name).write_text(
        broken.replace("x > 0.5", "neuron_gpu_memory_total_bytes > 0.5")
    )
    proc = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert proc.returncode != 0
    assert "NeuronGpuMemoryNearFull" in proc.stdout + proc.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    rules = yaml.safe_load(RULES.read_text())
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {a["alert"] for a in alerts(rules)}
    assert names, "no alerts"
    assert names - firing == set(), "alerts never tested firing"
    assert names - silent == set(), "alerts never tested not firing"
    assert firing | silent <= names, "tests of alerts that do not exist"


def test_every_alert_tells_on_call_what_to_do() -> None:
    for alert in alerts(yaml.safe_load(RULES.read_text())):
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name
        assert alert["annotations"]["summary"].strip(), name
        assert len(alert["annotations"]["description"]) > 100, name
