"""A real `neuron serve` subprocess with a tiny model: READY=1, drain with a stream in flight,
a second signal, exit codes. Real time is unavoidable with a subprocess: every wait is a
bounded polling loop.

The stream stays in flight on purpose: `engine.step=sleep(S)` (armed once serving) holds
the first step of the first request for S seconds, the window in which the drain is checked.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.engine.tiny_gguf import write_tiny_llama
from tests.neuron_process import free_port, run_neuron, spawn_neuron, write_config

pytestmark = pytest.mark.slow

READY_S = 120.0


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    base: str
    notify: socket.socket
    log_path: Path
    messages: list[str] = field(default_factory=list)

    def notifications(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.notify.recv(4096).decode())
            except BlockingIOError:
                return self.messages

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout}s:\n{self.log()[-3000:]}") from None


@pytest.fixture
def neuron(tmp_path: Path) -> Iterator[Running]:
    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    model = write_tiny_llama(state / "models" / "tiny.gguf", seed=1)
    port = free_port()
    config = write_config(
        tmp_path / "neuron.toml",
        server={"listen": [f"127.0.0.1:{port}"], "drain_timeout_s": 30},
        node={"state_dir": state},
        tp={"probe_interval_s": 3600},
        models=[
            {"name": "tiny", "source": model, "devices": "cpu", "dtype": "float32", "context": 256}
        ],
    )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    log_path = tmp_path / "neuron.log"
    env = {
        "NOTIFY_SOCKET": str(tmp_path / "notify"),
        "WATCHDOG_USEC": "2000000",
        "NEURON_FAILPOINTS": "engine.step=sleep(6)",
    }
    proc = spawn_neuron(config, log_path, env)
    running = Running(proc, f"http://127.0.0.1:{port}", sock, log_path)
    try:
        deadline = time.monotonic() + READY_S
        while not any(m.startswith("READY=1") for m in running.notifications()):
            assert proc.poll() is None, f"exited {proc.returncode}:\n{running.log()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready:\n{running.log()[-3000:]}"
            time.sleep(0.05)
        yield running
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()


def _stream_in_background(base: str) -> tuple[threading.Thread, list[str]]:
    lines: list[str] = []

    def consume() -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "stream": True,
        }
        try:
            with (
                httpx.Client(base_url=base, http1=False, http2=True, timeout=60) as client,
                client.stream("POST", "/v1/chat/completions", json=body) as response,
            ):
                lines.append(f"status {response.status_code}")
                lines.extend(line for line in response.iter_lines() if line)
        except httpx.HTTPError as exc:
            lines.append(f"error {exc!r}")

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    return thread, lines


def _wait_busy(base: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        doc = httpx.get(f"{base}/v1/node", timeout=10).json()
        model = doc["models"][0]
        if model["slots_in_use"] or model["queued"]:
            return
        time.sleep(0.02)
    raise AssertionError("the request never reached the model")


def test_ready_then_drain_with_a_stream_in_flight(neuron: Running) -> None:
    health = httpx.get(f"{neuron.base}/health", timeout=10)
    assert health.status_code == 200 and health.json()["starts"] == 1
    metrics = httpx.get(f"{neuron.base}/metrics", timeout=10).text
    assert "neuron_gpu_available 0.0" in metrics  # the GPU collector (no GPU here)
    thread, lines = _stream_in_background(neuron.base)
    _wait_busy(neuron.base)

    neuron.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not any(m.startswith("STOPPING=1") for m in neuron.notifications()):
        assert time.monotonic() < deadline, neuron.log()[-3000:]
        time.sleep(0.02)
    # Draining, the stream still in flight: health 503, a new request 503 with Retry-After.
    draining = httpx.get(f"{neuron.base}/health", timeout=10)
    assert draining.status_code == 503 and draining.json()["status"] == "draining"
    refused = httpx.post(
        f"{neuron.base}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10
    )
    assert refused.status_code == 503 and "retry-after" in refused.headers
    assert thread.is_alive()

    assert neuron.wait_exit(60) == 0, neuron.log()[-3000:]
    thread.join(30)
    assert lines[0] == "status 200" and lines[-1] == "data: [DONE]", lines
    messages = neuron.notifications()
    ready = next(i for i, m in enumerate(messages) if m.startswith("READY=1"))
    stopping = next(i for i, m in enumerate(messages) if m.startswith("STOPPING=1"))
    assert any(m.startswith("STATUS=loading tiny") for m in messages[:ready])
    assert "WATCHDOG=1" in messages[:ready]  # pings from the start
    assert ready < stopping
    log = neuron.log()
    assert "FAULT INJECTION ON" in log and "Traceback" not in log


def test_second_signal_stops_at_once(neuron: Running) -> None:
    thread, lines = _stream_in_background(neuron.base)
    _wait_busy(neuron.base)
    neuron.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while "draining" not in neuron.log():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    started = time.monotonic()
    neuron.proc.send_signal(signal.SIGTERM)
    # Killed by SIGTERM while the stream's step still sleeps (6 s): not a drain.
    assert neuron.wait_exit(10) == -signal.SIGTERM
    assert time.monotonic() - started < 5
    assert "exiting now" in neuron.log()
    thread.join(10)
    assert lines[-1] != "data: [DONE]"  # the stream was cut, not completed


def test_sigint_drains_too(neuron: Running) -> None:
    neuron.proc.send_signal(signal.SIGINT)
    assert neuron.wait_exit(60) == 0
    assert "SIGINT: draining" in neuron.log()


@pytest.mark.parametrize(
    ("name", "problem"),
    [("blocks.gguf", "block_count = 3000000"), ("loop.gguf", "chat template did not render")],
)
def test_a_hostile_default_model_is_exit_69_naming_the_problem(
    tmp_path: Path, name: str, problem: str
) -> None:
    from tests.engine.hostile_gguf import kv_str, llama_kvs, llama_tensors, raw_gguf

    models = tmp_path / "models"
    models.mkdir()
    loop = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
    kvs = {
        "blocks.gguf": llama_kvs(blocks=3_000_000),
        "loop.gguf": [*llama_kvs(), kv_str("tokenizer.chat_template", loop)],
    }[name]
    raw_gguf(models / name, kvs, llama_tensors())
    config = write_config(
        tmp_path / "neuron.toml",
        server={"listen": [f"127.0.0.1:{free_port()}"]},
        node={"state_dir": tmp_path / "state", "model_dirs": [models]},
        models=[{"name": "m", "source": name, "devices": "cpu"}],
    )
    done = run_neuron("serve", "--config", str(config))
    assert done.returncode == 69, done.stderr[-2000:]
    assert problem in done.stderr and "Traceback" not in done.stderr
