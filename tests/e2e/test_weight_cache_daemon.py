"""A real `neuron serve` fills the packed-weight cache on its first start and maps it on the
next (engine/model/load/weight_cache.py), logging where the start-up time went each time."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from neuron_trio.engine.model.load import packing
from tests.engine.tiny_gguf import write_tiny_llama
from tests.neuron_process import free_port, spawn_neuron, stop_neuron, wait_ready, write_config

pytestmark = pytest.mark.slow

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "the cat sat"}],
    "max_tokens": 8,
    "temperature": 0,
}


def start_chat_stop(tmp: Path, run: int, state: Path, model: Path, cache: bool) -> tuple[str, str]:
    """One start: (the greedy chat's text, the daemon's log)."""
    port = free_port()
    config = write_config(
        tmp / f"neuron-{run}.toml",
        server={"listen": [f"127.0.0.1:{port}"], "drain_timeout_s": 5},
        node={
            "state_dir": state,
            "model_dirs": [model.parent],
            "weight_cache": cache,
            "weight_cache_min_mb": 0,
        },
        tp={"probe_interval_s": 3600},
        models=[{"name": "tiny", "source": str(model), "devices": "cpu", "context": 128}],
    )
    log = tmp / f"neuron-{run}.log"
    proc = spawn_neuron(config, log)
    try:
        wait_ready(proc, port, log, 120)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=60)
        assert response.status_code == 200, response.text
        text: str = response.json()["choices"][0]["message"]["content"]
    finally:
        assert stop_neuron(proc) == 0, log.read_text()[-3000:]
    return text, log.read_text()


@pytest.mark.skipif(not packing.int4_available(), reason="no int kernels: auto is float32")
def test_the_second_start_maps_what_the_first_packed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    model = write_tiny_llama(state / "models" / "tiny.gguf", qtype="Q4_1", seed=2)
    first, log1 = start_chat_stop(tmp_path, 1, state, model, cache=True)
    entries = list((state / "cache" / "weights").glob("*.nwc"))
    assert len(entries) == 1  # written before the first daemon exited
    headers = list((state / "cache" / "weights" / "headers").glob("*.gguf-header.json"))
    assert len(headers) == 1  # the parsed GGUF header, read back by the next start
    second, log2 = start_chat_stop(tmp_path, 2, state, model, cache=True)
    phases1 = [line for line in log1.splitlines() if "start-up phases" in line]
    phases2 = [line for line in log2.splitlines() if "start-up phases" in line]
    assert len(phases1) == len(phases2) == 1
    assert "weight cache miss: storing in the background" in phases1[0]
    assert "pack " in phases1[0] and "warm-up" in phases1[0]
    assert "weight cache hit" in phases2[0] and "pack " not in phases2[0]
    assert first == second  # greedy: the same weights answer the same
    # off: nothing read, nothing written
    off, log3 = start_chat_stop(tmp_path, 3, tmp_path / "state-off", model, cache=False)
    assert off == first and "weight cache" not in log3
    assert not (tmp_path / "state-off" / "cache").exists()
