"""End-to-end wedge drills: a real `neuron serve` subprocess on the CPU, failpoints on.

The built-in model at tp = 3 (in-process communicator) or tp = 1, with short deadlines
(step_timeout_s = 10, abort_deadline_s = 5). Each drill either ends in exit 70 with the
forensics written, or in a node that serves again; never in a live process serving nothing.

Real time is unavoidable with a subprocess: every wait below is a bounded polling loop.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.neuron_process import BUSY_READY_S, free_port, spawn_neuron, write_config

pytestmark = pytest.mark.slow

MODEL = "drill"
STEP_S = 10.0  # generous: on 2 shared, busy cores a tp = 3 step must not time out by accident
ABORT_S = 5.0
EXIT_SLACK_S = 10.0  # "within step timeout + abort deadline + a few seconds"
RECOVER_SLACK_S = 30.0


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    base: str
    state_dir: Path
    log_path: Path
    health_seen: list[tuple[float, int, str]] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:]

    def health(self) -> tuple[int, str] | None:
        try:
            r = httpx.get(f"{self.base}/health", timeout=2.0)
        except httpx.HTTPError:
            return None
        try:
            status = str(r.json().get("status"))
        except ValueError:
            status = "?"
        self.health_seen.append((time.monotonic(), r.status_code, status))
        return r.status_code, status

    def wait_until(self, what: str, cond: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.2)
        raise AssertionError(f"not {what} within {timeout_s:g} s\n{self.log()}")

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"neuron exited {self.proc.returncode} on start\n{self.log()}")
            h = self.health()
            return h is not None and h[0] == 200

        self.wait_until("ready (/health 200)", ready, BUSY_READY_S)

    def complete(self, timeout_s: float = 60.0) -> httpx.Response:
        return httpx.post(
            f"{self.base}/v1/completions",
            json={
                "model": MODEL,
                "prompt": "The capital of France is",
                "max_tokens": 4,
                "temperature": 0,
            },
            timeout=timeout_s,
        )

    def complete_in_background(self) -> list[Any]:
        """Send a completion on a thread (it may hang until the wedge is handled)."""
        result: list[Any] = []

        def go() -> None:
            try:
                result.append(self.complete(timeout_s=STEP_S + ABORT_S + 30))
            except httpx.HTTPError as exc:
                result.append(exc)

        threading.Thread(target=go, name="drill-request", daemon=True).start()
        return result

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def forensics(self) -> list[dict[str, Any]]:
        folder = self.state_dir / "forensics"
        return (
            [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
            if folder.is_dir()
            else []
        )


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(*, tp: int, failpoints: str) -> Daemon:
        port = free_port()
        state_dir = tmp_path / "state"
        config = write_config(
            tmp_path / "neuron.toml",
            server={"listen": [f"127.0.0.1:{port}"]},
            node={"state_dir": state_dir},
            tp={"step_timeout_s": STEP_S, "abort_deadline_s": ABORT_S, "probe_interval_s": 3600},
            models=[
                {
                    "name": MODEL,
                    "source": "builtin:smollm2-135m",
                    "tp": tp,
                    "devices": "cpu",
                    "max_batch": 2,
                    "context": 512,
                }
            ],
        )
        log_path = tmp_path / "neuron.log"
        proc = spawn_neuron(
            config,
            log_path,
            {"NEURON_FAILPOINTS": failpoints, "XDG_STATE_HOME": str(tmp_path / "xdg")},
        )
        daemon = Daemon(proc, f"http://127.0.0.1:{port}", state_dir, log_path)
        started.append(daemon)
        daemon.wait_ready()
        return daemon

    yield start
    for daemon in started:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait(10)


def assert_exit_70_with_forensics(daemon: Daemon, sent_at: float, reason: str) -> dict[str, Any]:
    budget = STEP_S + ABORT_S + EXIT_SLACK_S
    saw_503 = False
    deadline = sent_at + budget
    while time.monotonic() < deadline and daemon.proc.poll() is None:
        h = daemon.health()
        if h is not None and h[0] == 503:
            assert h[1] in ("recovering", "wedged"), h
            saw_503 = True
        time.sleep(0.1)
    code = daemon.wait_exit(max(0.1, deadline - time.monotonic()))
    took = time.monotonic() - sent_at
    assert code == 70, f"exit {code} after {took:.1f} s\n{daemon.log()}"
    assert took >= STEP_S + ABORT_S - 0.5, f"exited too early ({took:.1f} s)"
    assert saw_503, f"/health never said 503: {daemon.health_seen[-5:]}"
    [report] = daemon.forensics()
    assert report["reason"] == reason, report["reason"]
    assert "nvidia_smi" in report and (
        "gpus" in report["nvidia_smi"] or "error" in report["nvidia_smi"]
    )
    assert report["deadlines_s"] == {"step_timeout_s": STEP_S, "abort_deadline_s": ABORT_S}
    # the same report was logged to stderr as one JSON line
    logged = [
        line for line in daemon.log().splitlines() if line.startswith('{"event":"neuron.deadman"')
    ]
    assert len(logged) == 1 and json.loads(logged[0])["reason"] == reason
    return report


def test_allreduce_and_abort_hang_exit_70(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(tp=3, failpoints="tp.allreduce=hang;tp.abort=hang")
    sent_at = time.monotonic()
    daemon.complete_in_background()
    report = assert_exit_70_with_forensics(daemon, sent_at, "abort-deadline")
    threads = {t["name"]: t for t in report["threads"]}
    abort = threads.get(f"nccl-abort-{MODEL}")
    assert abort is not None, sorted(threads)
    assert any("abort" in frame for frame in abort["stack"]), abort["stack"]
    assert any("failpoints.py" in frame for frame in abort["stack"]), abort["stack"]
    # The request in flight when the step wedged (already failed with 503 by then) is in
    # the report when the actor gives the watchdog its inflight_fn.
    assert "inflight" in report


def assert_recovers(daemon: Daemon) -> None:
    sent_at = time.monotonic()
    pending = daemon.complete_in_background()
    # the wedged request ends (503) once the step deadline fires
    daemon.wait_until(
        "the wedged request answered", lambda: bool(pending), STEP_S + ABORT_S + RECOVER_SLACK_S
    )
    first = pending[0]
    assert isinstance(first, httpx.Response) and first.status_code == 503, first
    daemon.wait_until(
        "serving again (/health 200)",
        lambda: daemon.proc.poll() is None and (daemon.health() or (0, ""))[0] == 200,
        STEP_S + ABORT_S + RECOVER_SLACK_S,
    )
    assert any(code == 503 for _, code, _ in daemon.health_seen) or time.monotonic() - sent_at > 0
    r = daemon.complete()
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    assert daemon.proc.poll() is None, f"exited {daemon.proc.returncode}\n{daemon.log()}"
    assert not daemon.forensics()
    metrics = httpx.get(f"{daemon.base}/metrics", timeout=5).text
    assert f'neuron_watchdog_recoveries_total{{model="{MODEL}"}} 1.0' in metrics, metrics[-3000:]


def test_allreduce_hang_abort_returns_node_recovers(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(tp=3, failpoints="tp.allreduce=hang")
    assert_recovers(daemon)
    metrics = httpx.get(f"{daemon.base}/metrics", timeout=5).text
    assert f'neuron_watchdog_aborts_total{{model="{MODEL}",outcome="returned"}} 1.0' in metrics


def test_abort_just_under_the_deadline_recovers(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(tp=3, failpoints=f"tp.allreduce=hang;tp.abort=sleep({ABORT_S - 0.6:g})")
    assert_recovers(daemon)


def test_tp1_step_hang_exit_70(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(tp=1, failpoints="engine.step=hang")
    sent_at = time.monotonic()
    daemon.complete_in_background()
    report = assert_exit_70_with_forensics(daemon, sent_at, "step-deadline")
    steps = [t for t in report["threads"] if t["name"] == f"neuron-step-{MODEL}"]
    assert steps and any("failpoints.py" in frame for frame in steps[0]["stack"])


def test_abort_error_came_back_recovers(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(tp=3, failpoints="tp.allreduce=hang;tp.abort=error")
    assert_recovers(daemon)
    metrics = httpx.get(f"{daemon.base}/metrics", timeout=5).text
    assert f'neuron_watchdog_aborts_total{{model="{MODEL}",outcome="error"}} 1.0' in metrics
