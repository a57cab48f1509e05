"""The router drill as a test: HAProxy (deploy/haproxy/neuron.cfg) in front of three real
neuron daemons, and a wedge, a drain, a kill and a node that wedges on every start.

bench/router_drill.py does the work (and, run by hand with the built-in model, gives the
README's table). Here the nodes serve a tiny random Llama (tests/engine/tiny_gguf.py), which
starts in seconds, so that the four scenarios and the eight starts they take fit in a few
minutes on a small machine; routing does not depend on what the model says.

What is asserted, per scenario: no client error among the requests started after the fault
(HAProxy retries what neuron refused with 503 and what a dead node never answered), the node
out of rotation within the configured check window, the streams in flight on a killed node
ended (complete or an error, never a hang), and the node back in rotation, except the one that wedges on
every start, which must end `failed` and stay out. The check-window bounds are the one place
where this test reads a clock: they are what the drill exists to prove, with seconds of slack.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from bench.router_drill import HAPROXY_CFG, STEP_TIMEOUT_S, drill, run_all
from tests.engine.tiny_gguf import write_tiny_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (apt-get install)"),
]

PHASE_TIMEOUT_S = 90.0  # each wait of the drill
TOTAL_S = 210.0  # all of them: the drill took ~3 minutes on 2 busy cores, start-ups included
SLACK_S = 2.0  # scheduling on a busy machine: the poller, the clients, the checks themselves


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s)", value)
    assert match is not None, value
    return int(match.group(1)) / (1000 if match.group(2) == "ms" else 1)


def check_window_s() -> float:
    """The longest a failing node can stay in rotation once its checks fail: `fall` checks at
    `inter` (the first one may have just passed), as deploy/haproxy/neuron.cfg sets them."""
    line = re.search(r"^\s*default-server (.*)$", HAPROXY_CFG.read_text(), re.M)
    assert line is not None
    words = line.group(1).split()
    inter = _seconds(words[words.index("inter") + 1])
    fall = int(words[words.index("fall") + 1])
    return (fall + 1) * inter


def test_haproxy_routes_around_every_fault(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    model = write_tiny_llama(tmp_path / "models" / "tiny.gguf", seed=1)
    with drill(restart_sec=1.0, burst=4, root=tmp_path, source=str(model)) as d:
        wedge, drain, kill, bad = run_all(d, timeout_s=PHASE_TIMEOUT_S, total_s=TOTAL_S)
    window = check_window_s()
    report = "\n".join(repr(r) for r in (wedge, drain, kill, bad))

    for r in (wedge, drain, kill, bad):
        assert r.requests_after_fault > 0, report
        assert r.errors_after_fault == 0, report
        assert r.out_of_rotation_s is not None, report
    # A wedged step is noticed when tp.step_timeout_s has passed (its requests get 503, /health
    # says recovering): from then on, one check window.
    for r in (wedge, bad):
        assert r.out_of_rotation_s is not None
        assert r.out_of_rotation_s <= STEP_TIMEOUT_S + window + SLACK_S, report
    for r in (drain, kill):
        assert r.out_of_rotation_s is not None
        assert r.out_of_rotation_s <= window + SLACK_S, report

    # Back in rotation after the restart; the wedged node exited 70 first.
    for r in (wedge, drain, kill):
        assert r.back_in_rotation_s is not None and r.final_proxy_status == "UP", report
    assert any(e.endswith("exited 70") for e in wedge.unit_events), report
    assert any("exited 0" in e for e in drain.unit_events), report
    assert any("exited -9" in e for e in kill.unit_events), report
    # A drained node's streams finish; a killed node's streams end, never hang. One may still
    # read its [DONE]: the fault's time is taken just before the signal, so a stream the node
    # finished in that instant (or whose last bytes sat in HAProxy's buffer) ends complete; a
    # dead process writes nothing more, so any other ending (an error event, a reset, a stream
    # closed without [DONE]) is one the client can tell from a whole answer.
    assert all(s == "stream: [DONE]" for s in drain.inflight_on_node), report
    for s in kill.inflight_on_node:
        assert "Timeout" not in s, report
    # Wedged on every start: four starts (StartLimitBurst), then `failed`, out for good.
    assert bad.final_unit_state == "failed", report
    assert bad.final_proxy_status == "DOWN", report
    assert sum(" started" in e for e in bad.unit_events) == 4, report
    assert sum("exited 70" in e for e in bad.unit_events) == 4, report
