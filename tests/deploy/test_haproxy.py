"""deploy/haproxy/neuron.cfg: HAProxy accepts it as shipped and as the drill rewrites it, and it
holds the settings that deploy/haproxy/README.md argues for (bench/router_drill.py measures
them against real daemons; tests/e2e/test_router_drill.py asserts the outcome)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.router_drill import HAPROXY_CFG, drill_haproxy_config
from neuron_trio.config import WatchdogConfig


def _haproxy() -> str:
    path = shutil.which("haproxy")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("haproxy is missing under CI (apt-get install haproxy)")
        pytest.skip("haproxy is not installed (Debian: apt-get install haproxy)")
    return path


def _check(path: Path) -> None:
    run = subprocess.run(
        [_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_shipped_config_is_valid() -> None:
    _check(HAPROXY_CFG)


def test_the_drills_rewrite_is_valid_and_keeps_every_other_line(tmp_path: Path) -> None:
    shipped = HAPROXY_CFG.read_text()
    ports = {"neuron1": 1001, "neuron2": 1002, "neuron3": 1003}
    text = drill_haproxy_config(shipped, 9999, tmp_path / "s.sock", ports)
    (tmp_path / "drill.cfg").write_text(text)
    _check(tmp_path / "drill.cfg")
    assert "bind 127.0.0.1:9999" in text
    assert "server neuron1 127.0.0.1:1001 disabled" in text
    assert "server neuron3 127.0.0.1:1003\n" in text

    def kept(t: str) -> list[str]:
        return [
            line
            for line in t.splitlines()
            if not re.match(r"\s*(bind|server|stats socket|log /dev/log|log stdout)\b", line)
        ]

    assert kept(text) == kept(shipped)


def test_the_settings_the_readme_argues_for() -> None:
    text = HAPROXY_CFG.read_text()
    default_server = re.search(r"^\s*default-server (.*)$", text, re.M)
    assert default_server is not None
    options = default_server.group(1).split()
    for want in ("check", "observe", "layer7", "on-error", "mark-down", "h2"):
        assert want in options, want
    assert options[options.index("proto") + 1] == "h2"
    assert options[options.index("check-proto") + 1] == "h2"
    assert re.search(r"^\s*retry-on conn-failure empty-response 503$", text, re.M)
    assert re.search(r"^\s*option redispatch 1$", text, re.M)
    assert re.search(r"^\s*http-check expect status 200$", text, re.M)
    assert "on-marked-down shutdown-sessions" not in re.sub(r"#.*", "", text)
    # a request caught by a wedge must get neuron's 503 (retried), not HAProxy's 504:
    # timeout server above watchdog.step_timeout_s's default (config.py: the one place)
    server_timeout = re.search(r"^\s*timeout server (\d+)s$", text, re.M)
    default = WatchdogConfig().step_timeout_s
    assert server_timeout is not None and int(server_timeout.group(1)) > default
