"""A real `neuron serve` warms its model up before `/health` answers 200, then serves."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.engine.tiny_gguf import write_tiny_llama
from tests.neuron_process import free_port, spawn_neuron, wait_ready, write_config

pytestmark = pytest.mark.slow

READY_S = 120.0
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "the cat sat"}],
    "max_tokens": 8,
    "temperature": 0,
}


def _start_chat_stop(config: Path, log: Path, port: int) -> str:
    proc = spawn_neuron(config, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, port, log, READY_S)
        response = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60)
        assert response.status_code == 200, response.text
        text: str = response.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0, log.read_text()[-3000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return text


def test_the_model_is_warmed_up_before_ready(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    write_tiny_llama(state / "models" / "tiny.gguf", qtype="Q4_1", seed=2)
    port = free_port()
    config = write_config(
        tmp_path / "neuron.toml",
        server={"listen": [f"127.0.0.1:{port}"], "drain_timeout_s": 5},
        node={"state_dir": state},
        models=[
            {
                "name": "tiny",
                "source": state / "models" / "tiny.gguf",
                "devices": "cpu",
                "dtype": "auto",
                "max_batch": 4,
                "context": 128,
            }
        ],
    )
    log = tmp_path / "neuron.log"
    text = _start_chat_stop(config, log, port)
    lines = log.read_text().splitlines()
    warmed = next(i for i, line in enumerate(lines) if "warmed up" in line)
    serving = next(i for i, line in enumerate(lines) if "serving (start-up took" in line)
    assert warmed < serving  # the warm-up ran before the node reported ready
    assert text
