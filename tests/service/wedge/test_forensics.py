"""The forensics report: real threads (a fake abort blocked on an Event), bounded parts."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from msgspec import to_builtins

from neuron_trio.service.wedge import forensics


def fake_nccl_abort(release: threading.Event) -> None:
    """Stands in for an ncclCommAbort that never returns."""
    release.wait()


@pytest.fixture
def hung_abort_thread() -> Iterator[threading.Thread]:
    release = threading.Event()
    thread = threading.Thread(
        target=fake_nccl_abort, args=(release,), name="nccl-abort-smollm2", daemon=True
    )
    thread.start()
    yield thread
    release.set()
    thread.join(5)


@pytest.fixture
def no_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def fake_nvidia_smi(folder: Path, body: str) -> None:
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


class Comm:
    def __init__(self, error: str | None = None, hang: threading.Event | None = None) -> None:
        self.error = error
        self.hang = hang

    def async_error(self) -> str | None:
        if self.hang is not None:
            self.hang.wait()
        return self.error

    def describe(self) -> dict[str, object]:
        return {"kind": "inprocess", "world_size": 3}


def test_thread_stacks_show_where_the_abort_hangs(hung_abort_thread: threading.Thread) -> None:
    stacks = {t.name: t for t in forensics.thread_stacks()}
    abort = stacks["nccl-abort-smollm2"]
    assert abort.daemon is True
    assert any("in fake_nccl_abort" in frame for frame in abort.stack)
    assert "in wait" in abort.stack[-1]  # innermost frame last: threading.Event.wait
    assert "MainThread" in stacks


def test_report_has_every_part(no_nvidia_smi: None, hung_abort_thread: threading.Thread) -> None:
    since = time.time() - 65.0
    report = to_builtins(
        forensics.gather_forensics(
            what="model m: step",
            since=since,
            deadline_s={"step_timeout_s": 2.0, "abort_deadline_s": 3.0},
            inflight=[{"id": "cmpl-1", "model": "m", "age_s": 66.0}],
            comms=[Comm("ncclRemoteError")],
            reason="abort-deadline",
        )
    )
    assert report["what"] == "model m: step" and report["reason"] == "abort-deadline"
    assert 64.0 < report["wedged_for_s"] < 70.0
    assert report["deadlines_s"] == {"step_timeout_s": 2.0, "abort_deadline_s": 3.0}
    assert report["inflight"] == [{"id": "cmpl-1", "model": "m", "age_s": 66.0}]
    assert report["inflight_count"] == 1
    assert report["nvidia_smi"] == {"error": "nvidia-smi not found on PATH"}
    assert "gpus" in report["nvml"] or "error" in report["nvml"]
    assert report["nccl"] == [
        {"describe": {"kind": "inprocess", "world_size": 3}, "async_error": "ncclRemoteError"}
    ]
    names = [t["name"] for t in report["threads"]]
    assert "nccl-abort-smollm2" in names
    json.loads(forensics.to_json(report))  # serialisable, one line
    assert "\n" not in forensics.to_json(report)


def test_nvidia_smi_is_read_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(
        tmp_path / "bin",
        'echo "0, GPU-aaaa, 70000, 81559, 0"\necho "1, GPU-bbbb, 69000, 81559, [N/A]"',
    )
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    report = to_builtins(forensics.gather_forensics(what="w", since=None, deadline_s=None))
    gpus = report["nvidia_smi"]["gpus"]
    assert gpus[0] == {
        "index": 0,
        "uuid": "GPU-aaaa",
        "memory_used_mib": 70000,
        "memory_total_mib": 81559,
        "utilization_gpu_pct": 0,
    }
    assert gpus[1]["uuid"] == "GPU-bbbb"


def test_a_hanging_nvidia_smi_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(tmp_path / "bin", "exec sleep 30")
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ["PATH"])
    started = time.monotonic()
    report = to_builtins(
        forensics.gather_forensics(what="w", since=None, deadline_s=None, nvidia_smi_timeout_s=0.3)
    )
    assert time.monotonic() - started < 5.0
    assert "timed out" in report["nvidia_smi"]["error"]


def test_a_hanging_part_is_bounded(no_nvidia_smi: None) -> None:
    stuck = threading.Event()
    try:
        started = time.monotonic()
        report = to_builtins(
            forensics.gather_forensics(
                what="w", since=None, deadline_s=None, comms=[Comm(hang=stuck)], part_timeout_s=0.2
            )
        )
        assert time.monotonic() - started < 3.0
        assert report["nccl"] == [{"error": "timed out after 0.2 s"}]
        # the helper thread still hung shows in the stacks too
        assert any(t["name"] == "forensics-comm-0" for t in report["threads"])
    finally:
        stuck.set()


def test_write_report_atomically(tmp_path: Path) -> None:
    first = forensics.write_report(tmp_path, {"n": 1}, now=1_800_000_000.0)
    second = forensics.write_report(tmp_path, {"n": 2}, now=1_800_000_001.5)
    assert first.parent == tmp_path / "forensics"
    assert first.name == "20270115T080000.000000Z.json"
    assert sorted(p.name for p in (tmp_path / "forensics").iterdir()) == [first.name, second.name]
    assert json.loads(second.read_text()) == {"n": 2}


def test_the_gpus_are_read_through_gpu_nvml_and_a_hung_driver_is_bounded(
    no_nvidia_smi: None,
) -> None:
    from neuron_trio.gpu.nvml import NvmlProbe
    from tests.gpu.fake_nvml import FakeNvml

    nvml = FakeNvml(count=2)
    report = to_builtins(
        forensics.gather_forensics(
            what="w", since=None, deadline_s=None, gpu_probe=NvmlProbe(module=nvml)
        )
    )
    assert report["nvml"]["available"] is True
    assert [g["index"] for g in report["nvml"]["gpus"]] == [0, 1]
    assert {"memory_used_bytes", "memory_total_bytes", "uuid"} <= set(report["nvml"]["gpus"][0])
    hung = FakeNvml(count=2)
    hung.hang = threading.Event()
    started = time.monotonic()
    report = to_builtins(
        forensics.gather_forensics(
            what="w",
            since=None,
            deadline_s=None,
            part_timeout_s=0.2,
            gpu_probe=NvmlProbe(module=hung),
        )
    )
    hung.hang.set()
    assert report["nvml"]["error"] == "timed out after 0.2s"
    assert time.monotonic() - started < 5.0
