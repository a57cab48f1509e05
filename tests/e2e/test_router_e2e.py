"""A real `neuron serve` as a router sees it: an ORCA header Envoy can read, `/health`'s load,
and its prompt's blocks on the KV-events socket in vLLM's schema."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import zmq

from tests.engine.tiny_gguf import write_tiny_llama
from tests.http.orca_envoy import HEADER, parse_orca_headers
from tests.neuron_process import free_port, spawn_neuron, wait_ready, write_config
from tests.service.vllm_kv_events import DECODER, END_SEQ, BlockStored

pytestmark = pytest.mark.slow

# token ids of the tiny vocabulary (byte symbols): 40 of them, two full blocks and 8 more
PROMPT = [40 + (i * 7) % 60 for i in range(40)]


def _replay_all(endpoint: str) -> list[object]:
    """Every event the replay socket holds, from the first batch on."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        events: list[object] = []
        while True:
            assert dealer.poll(10_000), "no answer from the replay socket"
            frames = dealer.recv_multipart()
            if frames[1] == END_SEQ:
                return events
            events += DECODER.decode(frames[2]).events
    finally:
        dealer.close()


def test_a_real_node_reports_its_load_and_publishes_its_prompt_blocks(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    write_tiny_llama(state / "models" / "tiny.gguf", qtype="Q4_1", seed=2)
    port = free_port()
    events_sock, replay_sock = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    config = write_config(
        tmp_path / "neuron.toml",
        server={"listen": [f"127.0.0.1:{port}"], "drain_timeout_s": 5},
        node={"state_dir": state},
        kv_events={
            "enabled": True,
            "endpoint": events_sock,
            "replay_endpoint": replay_sock,
            "topic": "kv@10.0.0.7@{model}",
        },
        models=[
            {
                "name": "tiny",
                "source": state / "models" / "tiny.gguf",
                "devices": "cpu",
                "max_batch": 4,
                "context": 128,
            }
        ],
    )
    log = tmp_path / "neuron.log"
    proc = spawn_neuron(config, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, port, log)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        r = httpx.post(
            f"{base}/v1/completions",
            json=body,
            headers={"endpoint-load-metrics-format": "text"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(PROMPT)
        report = parse_orca_headers([(HEADER, r.headers[HEADER])])
        assert set(report.named_metrics) == {
            "kv_cache_usage_perc", "num_requests_waiting", "num_requests_running",
        }  # fmt: skip
        assert 0.0 <= report.named_metrics["kv_cache_usage_perc"] <= 1.0
        assert report.application_utilization >= 0.0

        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["load"] == {
            "num_requests_waiting": 0,
            "num_requests_running": 0,
            "kv_cache_usage_perc": 0.0,  # the request ended: its blocks are cached, not used
            "application_utilization": 0.0,
        }

        stored = []
        for _ in range(100):  # the publisher flushes every 50 ms
            stored = [e for e in _replay_all(replay_sock) if isinstance(e, BlockStored)]
            if stored:
                break
            time.sleep(0.05)
        # the prompt's two full blocks, as one chain from the first (warm-up blocks, cached
        # before the publisher attached, are never published: their chains are unknown)
        assert [e.token_ids for e in stored] == [PROMPT[:32]]
        assert len(stored[0].block_hashes) == 2 and stored[0].parent_block_hash is None
        assert stored[0].block_size == 16
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0, log.read_text()[-3000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
