"""A real daemon against hostile model files (issue 25, findings 2 and 5), end to end.

- A chat template that loops only on 4-message chats loads (its 3-message probe renders); a
  4-message chat then fails alone (500), while /health answers and the built-in model serves,
  and SIGTERM still drains and exits 0. Before: the render ran on the event loop, froze /health
  and every model for 30 s and more, and SIGTERM was ignored.
- A default model whose tokenizer made a Rust library panic exits 69 (the contract), not 1.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.tiny_gguf import CHATML_TEMPLATE, write_tiny_llama, write_with_vocab
from tests.neuron_process import free_port, spawn_neuron
from tests.neuron_process import write_config as neuron_config

pytestmark = pytest.mark.slow

LOOP = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
BUILTIN = "smollm2-135m"


def write_config(path: Path, state: Path, models: Path, port: int, default: str) -> None:
    neuron_config(
        path,
        server={"listen": [f"127.0.0.1:{port}"], "drain_timeout_s": 10},
        node={"state_dir": state, "model_dirs": [models]},
        models=[
            {"name": "default", "source": default, "devices": "cpu", "max_batch": 2, "context": 512}
        ],
    )


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    models = tmp_path / "models"
    models.mkdir()
    port = free_port()
    config = tmp_path / "neuron.toml"
    write_config(config, tmp_path / "state", models, port, f"builtin:{BUILTIN}")
    log = tmp_path / "neuron.log"
    process = spawn_neuron(config, log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready within 240 s"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield process, base, models
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def chat(model: str, n: int) -> dict[str, object]:
    messages = [{"role": "user", "content": f"message {i}"} for i in range(n)]
    return {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}


def test_a_template_looping_on_four_messages_fails_that_request_alone(
    daemon: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    process, base, models = daemon
    template = "{% if messages|length == 4 %}" + LOOP + "{% endif %}" + CHATML_TEMPLATE
    write_tiny_llama(models / "loop4.gguf", chat_template=template)
    with httpx.Client(base_url=base, timeout=120) as http:
        r = http.post("/v1/models", json={"name": "loop4", "source": "loop4.gguf"})
        assert r.status_code == 201, r.text

        looping: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: looping.append(
                httpx.post(base + "/v1/chat/completions", json=chat("loop4", 4), timeout=120)
            )
        )
        thread.start()
        health: list[int] = []
        served: list[int] = []
        while thread.is_alive():
            # each answered while the template loops on its worker thread
            health.append(http.get("/health", timeout=10).status_code)
            if not served:
                served.append(
                    http.post("/v1/chat/completions", json=chat("default", 1)).status_code
                )
            time.sleep(0.05)
        thread.join()
        assert looping[0].status_code == 500, looping[0].text
        assert looping[0].json()["error"]["code"] == "chat_template_limit"
        assert health and set(health) == {200}
        assert served == [200]
        # the same model still serves other chats, and the node still drains on SIGTERM
        assert http.post("/v1/chat/completions", json=chat("loop4", 2)).status_code == 200
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0


def test_a_default_model_whose_tokenizer_panics_is_exit_69(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_with_vocab(models / "merge.gguf", lambda t, y, m: m.append("<|endoftext|> <|endoftext|>"))
    config = tmp_path / "neuron.toml"
    write_config(config, tmp_path / "state", models, free_port(), "merge.gguf")
    log = tmp_path / "neuron.log"
    process = spawn_neuron(config, log)
    try:
        code = process.wait(120)
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text(errors="replace")
    assert code == 69, text[-3000:]
    assert "which is not a token" in text and "Traceback" not in text
