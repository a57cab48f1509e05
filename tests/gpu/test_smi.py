"""run_nvidia_smi: parsing, a missing binary, a failing one, a hanging one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neuron_trio.gpu.smi import parse_csv, run_nvidia_smi


def _fake_smi(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return script


def test_parse_csv() -> None:
    rows = parse_csv("0, GPU-a, 1024, 143771, 37\n1, GPU-b, [N/A], 143771, [Not Supported]\n\n")
    assert rows[0] == {
        "index": 0,
        "uuid": "GPU-a",
        "memory_used_mib": 1024,
        "memory_total_mib": 143771,
        "utilization_gpu_pct": 37,
    }
    assert rows[1]["memory_used_mib"] is None and rows[1]["utilization_gpu_pct"] is None


def test_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "not found" in run_nvidia_smi(1)["error"]


def test_reads_live(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_smi(tmp_path, 'echo "0, GPU-x, 5, 80, 99"')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    assert run_nvidia_smi(10) == {
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-x",
                "memory_used_mib": 5,
                "memory_total_mib": 80,
                "utilization_gpu_pct": 99,
            }
        ]
    }


def test_failure_names_the_exit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_smi(tmp_path, 'echo "NVIDIA-SMI has failed" >&2; exit 9')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    assert run_nvidia_smi(10) == {"error": "nvidia-smi exited 9: NVIDIA-SMI has failed"}


def test_hang_is_bounded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # `exec sleep` so the kill reaches the sleeping process itself.
    _fake_smi(tmp_path, "exec sleep 600")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    assert run_nvidia_smi(0.2) == {"error": "nvidia-smi timed out after 0.2s"}
