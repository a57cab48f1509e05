"""A failpoint says when it fires: drills (bench/router_drill.py) date a wedge from that line."""

from __future__ import annotations

import logging

import pytest

from neuron_trio import failpoints as fp


def test_a_failpoint_logs_once_when_it_fires(caplog: pytest.LogCaptureFixture) -> None:
    registry = fp.Failpoints()
    registry.configure(fp.parse("engine.step=sleep(0)"))
    registry.reach("engine.step")  # not armed yet: nothing happens, nothing is logged
    assert not caplog.records
    registry.arm()
    with caplog.at_level(logging.WARNING, logger="neuron_trio.failpoints"):
        registry.reach("engine.step")
        registry.reach("engine.step")  # fired once: the second reach does nothing
    assert [r.getMessage() for r in caplog.records] == ["failpoint engine.step fired: sleep(0)"]
