"""The deadman: forensics written and logged as one line, flags, then exit 70.

In-process tests inject `exit_fn` (it records the code; `fire` then raises DeadmanExit); one
test runs a real subprocess to see `os._exit(70)` with an abandoned thread still blocked.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from neuron_trio.service.wedge.deadman import Deadman, DeadmanExit


def fake_nccl_abort(release: threading.Event) -> None:
    release.wait()


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


@pytest.fixture
def no_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def make(tmp_path: Path, **kw: Any) -> tuple[Deadman, Exits, Path]:
    exits = Exits()
    stderr_path = tmp_path / "stderr.log"
    fd = open(stderr_path, "wb")  # noqa: SIM115 - closed by the test's end (kept for the deadman)
    deadman = Deadman(tmp_path / "state", exit_fn=exits, stderr_fd=fd.fileno(), **kw)
    deadman._test_stderr = fd  # type: ignore[attr-defined]
    return deadman, exits, stderr_path


def fire(deadman: Deadman, reason: str, **kw: Any) -> None:
    """`deadman.fire` in a trio run of its own; DeadmanExit comes out (the fake exit returns)."""
    trio.run(partial(deadman.fire, reason, **kw))


def check_report(tmp_path: Path, stderr_path: Path, exc: DeadmanExit) -> dict[str, Any]:
    assert exc.code == 70
    files = list((tmp_path / "state" / "forensics").glob("*.json"))
    assert len(files) == 1 and exc.path == files[0]
    report = json.loads(files[0].read_text())
    lines = stderr_path.read_text().splitlines()
    assert len(lines) == 1, "the report is ONE log line"
    logged = json.loads(lines[0])
    assert logged["event"] == "neuron.deadman" and logged["written_to"] == str(files[0])
    assert logged["reason"] == report["reason"]
    return report


def test_fire_writes_logs_and_exits_70(tmp_path: Path, no_nvidia_smi: None) -> None:
    release = threading.Event()
    abort = threading.Thread(
        target=fake_nccl_abort, args=(release,), name="nccl-abort-m", daemon=True
    )
    abort.start()
    try:
        deadman, exits, stderr_path = make(
            tmp_path, context_fn=lambda: {"inflight": [{"id": "r1", "age_s": 5.0}], "models": ["m"]}
        )
        assert not deadman.firing
        with pytest.raises(DeadmanExit) as caught:
            fire(
                deadman,
                "abort-deadline",
                what="model m: step",
                since=time.time() - 5,
                deadlines_s={"step_timeout_s": 2.0, "abort_deadline_s": 3.0},
                inflight_at_wedge=[{"id": "r0", "age_s": 9.0}],
                details={"model": "m"},
            )
        assert exits.codes == [70]
        assert deadman.firing and deadman.reason == "abort-deadline"
        report = check_report(tmp_path, stderr_path, caught.value)
        assert report["inflight"] == [{"id": "r1", "age_s": 5.0}]
        assert report["inflight_at_wedge"] == [{"id": "r0", "age_s": 9.0}]
        assert report["extra"] == {"model": "m", "context": {"models": ["m"]}}
        assert report["nvidia_smi"] == {"error": "nvidia-smi not found on PATH"}
        assert report["exit_code"] == 70
        [thread] = [t for t in report["threads"] if t["name"] == "nccl-abort-m"]
        assert any("in fake_nccl_abort" in frame for frame in thread["stack"])
    finally:
        release.set()


def test_fire_from_trio_gathers_on_a_thread_and_exits(tmp_path: Path, no_nvidia_smi: None) -> None:
    deadman, exits, stderr_path = make(tmp_path)
    seen_firing: list[bool] = []

    async def health_poller() -> None:
        # The event loop keeps running while the deadman gathers: /health can say "wedged".
        while True:
            seen_firing.append(deadman.firing)
            await trio.sleep(0.001)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(health_poller)
            await deadman.fire("step-deadline", what="model m: step", since=None)

    with pytest.raises(BaseException) as caught:
        trio.run(main)
    exc = caught.value
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, DeadmanExit)
    assert exits.codes == [70]
    check_report(tmp_path, stderr_path, exc)
    assert True in seen_firing


def test_a_hanging_context_fn_does_not_hang_the_exit(tmp_path: Path, no_nvidia_smi: None) -> None:
    stuck = threading.Event()
    deadman, _exits, stderr_path = make(
        tmp_path, context_fn=lambda: stuck.wait(), part_timeout_s=0.2
    )
    started = time.monotonic()
    try:
        with pytest.raises(DeadmanExit) as caught:
            fire(deadman, "x", what="w", since=None)
    finally:
        stuck.set()
    assert time.monotonic() - started < 5.0
    report = check_report(tmp_path, stderr_path, caught.value)
    assert report["extra"]["context"] == {"context_error": "PartTimeout: timed out after 0.2 s"}


def test_gathering_that_overruns_writes_a_minimal_report(
    tmp_path: Path, no_nvidia_smi: None
) -> None:
    stuck = threading.Event()
    deadman, exits, stderr_path = make(
        tmp_path, context_fn=lambda: stuck.wait(), part_timeout_s=30, gather_timeout_s=0.2
    )
    try:
        with pytest.raises(DeadmanExit) as caught:
            fire(deadman, "x", what="w", since=1_800_000_000.0, details={"model": "m"})
    finally:
        stuck.set()
    assert exits.codes == [70]
    report = check_report(tmp_path, stderr_path, caught.value)
    assert report["gather_error"] == "gathering overran 0.2 s"
    assert report["since"] == "2027-01-15T08:00:00.000Z" and report["extra"] == {"model": "m"}
    assert "nvidia_smi" not in report and "inflight" not in report  # never gathered
    assert any(t["name"] == "neuron-deadman" for t in report["threads"])  # the one that hung


def test_an_unwritable_state_dir_still_exits(tmp_path: Path, no_nvidia_smi: None) -> None:
    (tmp_path / "state").write_text("a file, not a folder")
    deadman, exits, stderr_path = make(tmp_path)
    with pytest.raises(DeadmanExit) as caught:
        fire(deadman, "x", what="w", since=None)
    assert exits.codes == [70] and caught.value.path is None
    logged = json.loads(stderr_path.read_text())
    assert "write_error" in logged


SUBPROCESS = r"""
import sys, threading, time
from functools import partial
import trio
from neuron_trio.service.wedge.deadman import Deadman

def fake_nccl_abort(release):
    release.wait()

threading.Thread(target=fake_nccl_abort, args=(threading.Event(),), name="nccl-abort-m").start()
print("buffered stdout line", end="")  # must be flushed before os._exit
trio.run(partial(Deadman(sys.argv[1]).fire, "abort-deadline", what="model m: step", since=time.time()))
print("unreachable")
"""


def test_real_exit_70_with_a_blocked_non_daemon_thread(tmp_path: Path, no_nvidia_smi: None) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SUBPROCESS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 70, proc.stderr
    assert proc.stdout == "buffered stdout line"
    [path] = (tmp_path / "forensics").glob("*.json")
    report = json.loads(path.read_text())
    assert any(t["name"] == "nccl-abort-m" for t in report["threads"])
    records = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert len(records) == 1 and records[0]["written_to"] == str(path)
