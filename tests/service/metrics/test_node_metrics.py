"""Node series that survive restarts, zeroed watchdog counters, and the tokens/s window."""

from __future__ import annotations

import json
import os
from pathlib import Path

import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest

from neuron_trio.service.metrics.node import TOKEN_RATE_SAMPLE_S, RateWindow
from neuron_trio.service.metrics.watchdog import WatchdogMetrics
from tests.service.node_world import World, collect, job, make_config, run_world


def sample(text: str, line_start: str) -> float:
    [line] = [ln for ln in text.splitlines() if ln.startswith(line_start + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_node_series_carry_identity_status_and_the_last_deadman_exit(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        forensics = tmp_path / "state" / "forensics"
        forensics.mkdir(parents=True)
        report = forensics / "20260102T000000Z.json"
        report.write_text(json.dumps({"reason": "abort-deadline"}))
        os.utime(report, (1_790_000_000, 1_790_000_000))
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        text = generate_latest(node.metrics_registry).decode()
        assert sample(text, "neuron_node_starts_total") == 3  # node_world.Identity()
        assert sample(text, "neuron_node_start_time_seconds") == 1_767_225_600  # 2026-01-01
        assert 'neuron_node_info{boot_id="b00t",hostname="node-1",version="' in text
        assert sample(text, 'neuron_node_status{status="starting"}') == 1
        assert sample(text, 'neuron_node_status{status="ok"}') == 0
        assert sample(text, "neuron_node_last_forensics_timestamp_seconds") == 1_790_000_000
        node.mark_serving()
        text = generate_latest(node.metrics_registry).decode()
        assert sample(text, 'neuron_node_status{status="ok"}') == 1
        assert sample(text, 'neuron_node_status{status="starting"}') == 0

    run_world(tmp_path, test)


def test_no_forensics_report_is_zero(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        text = generate_latest(node.metrics_registry).decode()
        assert sample(text, "neuron_node_last_forensics_timestamp_seconds") == 0

    run_world(tmp_path, test)


def test_watchdog_counters_exist_at_zero_before_the_first_wedge() -> None:
    registry = CollectorRegistry()
    metrics = WatchdogMetrics.for_registry(registry)
    before = generate_latest(registry).decode()
    assert 'neuron_watchdog_wedges_total{model="m"' not in before
    metrics.zero("m")
    text = generate_latest(registry).decode()
    for series in (
        'neuron_watchdog_wedges_total{model="m",what="step"}',
        'neuron_watchdog_aborts_total{model="m",outcome="deadline"}',
        'neuron_watchdog_recoveries_total{model="m"}',
        'neuron_watchdog_idle_probes_total{model="m",result="timeout"}',
    ):
        assert sample(text, series) == 0, series


def test_rate_window_spans_the_last_minute() -> None:
    window = RateWindow(60.0)
    assert window.rate() is None
    window.add(0.0, 0.0)
    assert window.rate() is None
    for t in range(5, 121, 5):
        window.add(float(t), 10.0 * t if t <= 60 else 600.0)  # 10 tok/s for a minute, then idle
    assert window.rate() == 0.0  # the last minute was idle
    window = RateWindow(60.0)
    for t in range(0, 121, 5):
        window.add(float(t), 4.0 * t)
    assert window.rate() == 4.0
    window.add(125.0, 0.0)  # a reload resets the counter: start again
    assert window.rate() is None


def test_node_info_reports_generated_tokens_per_second(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        node.mark_serving()
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, trio.testing.MockClock)
        clock.jump(TOKEN_RATE_SAMPLE_S)  # the first sample with the model loaded
        await trio.testing.wait_all_tasks_blocked()
        assert (await node.node_info())["generated_tokens_per_s_1m"] == {"a": None}  # 1 sample
        for _ in range(3):
            await collect(node, job(max_tokens=2))
        clock.jump(30)  # the sampler wakes once: a second sample, 30 s after the first
        await trio.testing.wait_all_tasks_blocked()
        rate = (await node.node_info())["generated_tokens_per_s_1m"]["a"]
        assert rate is not None and 0 < rate <= 6 / 30

    run_world(tmp_path, test)
