"""deploy/: the systemd unit (verified by systemd-analyze), the example config, sysusers."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from neuron_trio.config import load_config
from neuron_trio.errors import ConfigError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "neuron.service"

EXPECTED: dict[str, dict[str, str | None]] = {
    "Unit": {
        "Description": None,
        "After": "network-online.target",
        "Wants": "network-online.target",
        "StartLimitIntervalSec": "600",
        "StartLimitBurst": "4",
    },
    "Service": {
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": "/usr/bin/neuron --config /etc/neuron/neuron.toml",
        "Restart": "on-failure",
        "RestartSec": "5",
        "RestartPreventExitStatus": "78",
        "User": "neuron",
        "Group": "neuron",
        "StateDirectory": "neuron",
        "StateDirectoryMode": "0700",
        "UMask": "0077",
        "Environment": "HOME=/var/lib/neuron",
        "TimeoutStartSec": "1800s",
        "TimeoutStopSec": "120s",
        "KillSignal": "SIGTERM",
        "WatchdogSec": "30s",
    },
    "Install": {"WantedBy": "multi-user.target"},
}


def _sections(text: str) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            assert key not in current, f"{key} twice"
            current[key] = value
    return sections


def _comment_before(text: str, directive: str) -> str:
    """The comment lines right above `directive=`, lower-cased, as one string."""
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(directive + "="))
    comment: list[str] = []
    for line in reversed(lines[:index]):
        if not line.startswith("#"):
            break
        comment.insert(0, line.lstrip("# "))
    return " ".join(comment).lower()


def test_every_directive() -> None:
    sections = _sections(UNIT.read_text())
    for section, directives in EXPECTED.items():
        for key, value in directives.items():
            assert key in sections[section], f"[{section}] {key}= missing"
            if value is not None:
                assert sections[section][key] == value, key


SANDBOX = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "LimitNOFILE": "65536",
    "ProtectKernelModules": "yes",
    "RestrictSUIDSGID": "yes",
    "CapabilityBoundingSet": "",
}
# Each of these would break the GPU path (/dev/nvidia*, JIT code, nvidia-smi).
GPU_BREAKERS = {
    "PrivateDevices": "yes",
    "MemoryDenyWriteExecute": "yes",
    "DevicePolicy": "closed",
    "PrivateUsers": "yes",
}


def test_the_unit_is_sandboxed_as_far_as_a_gpu_daemon_allows() -> None:
    text = UNIT.read_text()
    service = _sections(text)["Service"]
    for key, value in SANDBOX.items():
        assert service.get(key) == value, key
    for key, value in GPU_BREAKERS.items():
        assert service.get(key) != value, key
        assert key in text, f"the unit should say why {key} is left out"
    assert service["StateDirectory"] == "neuron"  # writable under ProtectSystem=strict


def test_systemd_analyze_security_exposure(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing in CI (.ci/run installs systemd)")
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "neuron.service"
    unit.write_text(UNIT.read_text().replace("ExecStart=/usr/bin/neuron ", "ExecStart=/bin/true "))
    proc = subprocess.run(
        [analyze, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "--offline" in proc.stderr and "unrecognized" in proc.stderr:
        pytest.skip("this systemd-analyze cannot check a unit offline")
    line = next(x for x in proc.stdout.splitlines() if "Overall exposure level" in x)
    exposure = float(line.split(":")[1].split()[0])
    assert exposure < 5.0, line  # 9.2 ("UNSAFE") before the sandboxing


def test_comments_say_why() -> None:
    text = UNIT.read_text()
    flapping = _comment_before(text, "StartLimitIntervalSec")
    assert "flapping" in flapping and "worse than a down" in flapping
    assert "router" in flapping and "healthy" in flapping
    state = _comment_before(text, "StateDirectory")
    assert "home" in state and "hub cache" in state
    assert "bad config" in _comment_before(text, "RestartPreventExitStatus")
    assert "event loop" in _comment_before(text, "WatchdogSec")


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing in CI (.ci/run installs systemd)")
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart exists: point a copy at a binary that does.
    text = UNIT.read_text().replace("ExecStart=/usr/bin/neuron ", "ExecStart=/bin/true ")
    unit = tmp_path / "neuron.service"
    unit.write_text(text)
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "neuron.service" not in proc.stderr, proc.stderr  # no warning about our unit


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "neuron.service"
    unit.write_text("[Service]\nType=notify\nExecStart=/nonexistent/neuron\n")
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0


def test_example_config_is_not_open_as_shipped(tmp_path: Path) -> None:
    # It names key files, so it does not load until they exist; and without the API key it
    # would be refused, not served openly.
    text = (DEPLOY / "neuron.toml").read_text()
    with pytest.raises(ConfigError, match="api_key_file"):
        load_config(DEPLOY / "neuron.toml", environ={})
    assert "\nallow_unauthenticated = false" in text
    keyless = tmp_path / "keyless.toml"
    keyless.write_text(text.replace('\napi_key_file = "', '\n# api_key_file = "'))
    with pytest.raises(ConfigError, match="not a loopback address"):
        load_config(keyless, environ={"NEURON_SERVER_ADMIN_KEY_FILE": str(_key(tmp_path))})


def _key(tmp_path: Path) -> Path:
    key = tmp_path / "key"
    key.write_text("k\n")
    return key


def test_example_config_loads(tmp_path: Path) -> None:
    key = str(_key(tmp_path))
    environ = {"NEURON_SERVER_API_KEY_FILE": key, "NEURON_SERVER_ADMIN_KEY_FILE": key}
    config = load_config(DEPLOY / "neuron.toml", environ=environ)
    assert config.server.listen == ["0.0.0.0:8080"]
    assert config.server.drain_timeout_s < 120  # below TimeoutStopSec
    assert config.node.state_dir == "/var/lib/neuron"
    assert [m.name for m in config.default_models] == ["smollm2-135m"]


def test_example_config_shows_every_key() -> None:
    text = (DEPLOY / "neuron.toml").read_text()
    from neuron_trio.config import (
        ModelConfig,
        NodeConfig,
        ServerConfig,
        TenantConfig,
        WatchdogConfig,
    )

    for struct in (ServerConfig, NodeConfig, WatchdogConfig, ModelConfig, TenantConfig):
        for key in struct.__struct_fields__:
            assert f"\n{key} =" in text or f"\n# {key} =" in text, key


def test_sysusers() -> None:
    line = next(
        line
        for line in (DEPLOY / "neuron.sysusers.conf").read_text().splitlines()
        if line and not line.startswith("#")
    )
    kind, name, _id, *_rest = line.split()
    assert (kind, name) == ("u", "neuron")
    assert "/var/lib/neuron" in line


def test_sysusers_creates_the_user(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(
        [sysusers, f"--root={tmp_path}", str(DEPLOY / "neuron.sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    entry = (tmp_path / "etc" / "passwd").read_text().split(":")
    assert entry[0] == "neuron" and entry[5] == "/var/lib/neuron"
