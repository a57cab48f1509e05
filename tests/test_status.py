"""`neuron status` against a real app: the HTTP server and the real Node (fake executor),
served on 127.0.0.1 from a trio thread; the command runs in the test's thread as a user would.

The slow drill in tests/e2e/test_operator_pack.py runs it against a real daemon too.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from neuron_trio import cli
from neuron_trio.config import config_from_mapping
from neuron_trio.service.node import Node
from neuron_trio.status import NodeStatus, default_url, parse_metrics, render
from tests.http.http_harness import serving_node
from tests.neuron_process import free_port
from tests.service.node_world import World, collect, job, make_config

KEY = "s3cret-key"


@dataclass
class LiveNode:
    url: str
    config_path: Path
    node: Node
    token: trio.lowlevel.TrioToken

    def call(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def call_sync(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)


@pytest.fixture
def live_node(tmp_path: Path) -> Iterator[LiveNode]:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    config = make_config(tmp_path, listen=[f"127.0.0.1:{free_port()}"], api_key_file=str(key_file))
    ready: list[LiveNode] = []
    started = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            w = World(nursery, tmp_path)
            node = w.node(config)
            async with serving_node(node, config) as url:
                config_path = tmp_path / "neuron.toml"
                config_path.write_text(
                    f'[server]\nlisten = ["{url.removeprefix("http://")}"]\n'
                    f'api_key_file = "{key_file}"\n'
                )
                ready.append(LiveNode(url, config_path, node, trio.lowlevel.current_trio_token()))
                started.set()
                await trio.to_thread.run_sync(stop.wait)
            nursery.cancel_scope.cancel()

    def thread() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            errors.append(exc)
            started.set()

    runner = threading.Thread(target=thread, name="live-node", daemon=True)
    runner.start()
    assert started.wait(60), "the node did not start"
    assert not errors, errors
    yield ready[0]
    stop.set()
    runner.join(30)
    assert not errors, errors


def run_status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    # cli.main points the root logger at this test's captured stderr: put it back after, or
    # later tests log into a closed stream.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        code = cli.main(["status", *args])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr()
    return code, out, err


def test_status_of_a_serving_node(live_node: LiveNode, capsys: pytest.CaptureFixture[str]) -> None:
    live_node.call(collect, live_node.node, job())
    code, out, err = run_status(capsys, "--config", str(live_node.config_path))
    assert code == 0, err
    assert "SERVING" in out.splitlines()[0] and "NOT SERVING" not in out
    assert "boot      b00t, start 3 in this state dir" in out  # node_world's Identity
    assert "  a  " in out and "serving" in out and "slots 0/2" in out and "queue 0/2" in out
    assert "requests 1 (429 0, failed in flight 0)" in out
    assert "watchdog idle: wedges 0" in out
    assert "forensics none" in out


def test_status_json_is_one_document(
    live_node: LiveNode, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_status(capsys, "--config", str(live_node.config_path), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["serving"] is True and doc["url"] == live_node.url
    assert doc["node"]["boot_id"] == "b00t" and doc["node"]["models"][0]["name"] == "a"
    assert doc["metrics"]['neuron_model_requests_total{model="a",outcome="length"}'] == 0


def test_status_exits_69_when_the_node_is_not_serving(
    live_node: LiveNode, capsys: pytest.CaptureFixture[str]
) -> None:
    live_node.call_sync(live_node.node.begin_drain)
    code, out, _ = run_status(capsys, "--config", str(live_node.config_path))
    assert code == 69
    assert "NOT SERVING (draining)" in out
    code, out, _ = run_status(capsys, "--config", str(live_node.config_path), "--json")
    assert code == 69 and json.loads(out)["serving"] is False


def test_status_without_the_api_key_says_so(
    live_node: LiveNode, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run_status(capsys, "--url", live_node.url, "--config", str(tmp_path / "none"))
    assert code == 78 and "cannot read" in err  # a config that does not exist
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    code, out, err = run_status(capsys, "--url", live_node.url, "--config", str(empty))
    assert code == 69 and out == ""
    assert "HTTP 401" in err and "api_key_file" in err


def test_status_of_a_node_that_is_down(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    code, out, err = run_status(
        capsys, "--url", "http://127.0.0.1:9", "--config", str(empty), "--json"
    )
    assert code == 69
    doc = json.loads(out)
    assert doc["serving"] is False and "cannot connect" in doc["error"]
    assert "cannot connect" in err


def test_default_url_follows_the_config(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k\n")

    def url(**server: Any) -> str:
        return default_url(config_from_mapping({"server": server}, origin="t", environ={}))

    assert url() == "http://127.0.0.1:8080"
    assert url(listen=["0.0.0.0:9000"], api_key_file=str(key)) == "http://127.0.0.1:9000"
    assert url(listen=["[::]:9000"], api_key_file=str(key)) == "http://[::1]:9000"
    assert url(listen=["[::1]:9001"]) == "http://[::1]:9001"


def test_render_summarises_the_last_forensics_report_and_a_wedge() -> None:
    node = {
        "hostname": "gpu-7",
        "boot_id": "abc",
        "starts": 5,
        "previous_stop_clean": False,
        "started_at": "2026-01-01T00:00:00Z",
        "status": "recovering",
        "gpus": {
            "available": True,
            "gpus": [
                {
                    "index": 0,
                    "name": "H100",
                    "memory_used_bytes": 40 << 30,
                    "memory_total_bytes": 80 << 30,
                    "utilization_gpu_pct": 97,
                }
            ],
        },
        "watchdog": {"step_timeout_s": 30, "abort_deadline_s": 60, "probe_interval_s": 30},
        "last_forensics": {
            "path": "/var/lib/neuron/forensics/x.json",
            "report": {
                "at": "2025-12-31T23:00:00Z",
                "reason": "abort-deadline",
                "what": "step",
                "wedged_for_s": 90.1,
                "inflight_count": 3,
            },
        },
        "generated_tokens_per_s_1m": {"llama": 812.5},
        "models": [
            {
                "name": "llama",
                "state": "recovering",
                "tp": 2,
                "devices": ["cuda:0", "cuda:1"],
                "weights": "bfloat16",
                "slots_in_use": 8,
                "slots_total": 8,
                "kv_cache": {
                    "block_tokens": 16,
                    "blocks_total": 2048,
                    "blocks_used": 300,
                    "blocks_cached": 12,
                    "prefix_cache": True,
                    "prefix_cache_queries_tokens": 4000,
                    "prefix_cache_hits_tokens": 3000,
                    "preemptions": 2,
                },
                "queued": 5,
                "max_queue": 64,
                "steps": 100,
                "step_failures": 1,
                "watchdog": {
                    "state": "aborting",
                    "wedges": 1,
                    "aborts": {"returned": 0, "error": 0, "deadline": 0},
                    "recoveries": 0,
                    "probes": 4,
                    "last_wedge": {"what": "step", "at": "2026-01-01T00:59:00Z"},
                },
            }
        ],
    }
    metrics = parse_metrics(
        "# TYPE neuron_model_requests_total counter\n"
        'neuron_model_requests_total{model="llama",outcome="stop"} 90\n'
        'neuron_model_requests_total{model="llama",outcome="rejected_queue_full"} 7\n'
        'neuron_model_requests_total{model="llama",outcome="unavailable"} 3\n'
    )
    status = NodeStatus(node=node, metrics=metrics)
    assert status.exit_code() == 69
    text = render(status, url="http://127.0.0.1:8080", now=1767229200.0)  # 01:00 UTC
    assert "NOT SERVING (recovering)" in text
    assert "start 5 in this state dir, up 1h 0m" in text
    assert "the process before did NOT stop cleanly" in text
    assert "gpu 0     H100: 40.0/80.0 GiB, util 97%" in text
    assert (
        "forensics 2025-12-31T23:00:00Z: abort-deadline: step wedged for 90.1 s, 3 requests" in text
    )
    assert "tp 2 on cuda:0,cuda:1, weights bfloat16" in text
    assert "slots 8/8   queue 5/64   812.5 tok/s (1 min)" in text
    assert "kv blocks 300/2048 (+12 cached)   prefix hits 75%   preemptions 2" in text
    assert "requests 100 (429 7, failed in flight 3)" in text
    assert (
        "watchdog aborting: wedges 1" in text and "last wedge: step at 2026-01-01T00:59:00Z" in text
    )


def test_an_unreadable_api_key_file_is_78(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "neuron.toml"
    config.write_text(f'[server]\napi_key_file = "{tmp_path / "missing"}"\n')
    code, out, err = run_status(capsys, "--config", str(config))
    assert code == 78 and out == ""
    assert "api_key_file" in err


def test_render_reads_the_document_a_non_operator_gets() -> None:
    """With `admin_key_file` set, `neuron status` asks with a tenant's key: the last forensics
    report is hidden (a string) and the prefix cache's counters null."""
    from neuron_trio.http.tenancy import HIDDEN, redact_node_info

    node = {
        "status": "ok",
        "last_forensics": {"path": "/state/forensics/x.json", "report": {"reason": "r"}},
        "models": [
            {
                "name": "m",
                "path": "/models/m.gguf",
                "kv_cache": {
                    "blocks_total": 10,
                    "prefix_cache_queries_tokens": 64,
                    "prefix_cache_hits_tokens": 32,
                },
            }
        ],
    }
    text = render(NodeStatus(node=redact_node_info(node), metrics={}), url="http://n")
    assert f"forensics {HIDDEN}" in text
    assert "prefix hits -" in text and "kv blocks 0/10" in text
