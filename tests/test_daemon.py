"""The root nursery with doubles for the node and the HTTP server: order, drain, exit codes."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from neuron_trio import daemon, failpoints
from neuron_trio.config import NeuronConfig, config_from_mapping
from neuron_trio.errors import ModelLoadError
from neuron_trio.gpu.nvml import GpuSnapshot


class NoGpu:
    def read_sync(self, timeout_s: float = 2.0) -> GpuSnapshot:
        return GpuSnapshot(available=False, reason="test: no GPU")

    async def read(self, timeout_s: float = 2.0) -> GpuSnapshot:
        return GpuSnapshot(available=False, reason="test: no GPU")


class FakeNode:
    """Records the daemon's calls; `in_flight` requests hold `wait_idle`."""

    def __init__(
        self, events: list[str], *, fail_load: bool = False, hang_load: bool = False
    ) -> None:
        self.events = events
        self.fail_load = fail_load
        self.hang_load = hang_load
        self.in_flight = 0
        self.idle = trio.Event()
        self.notifier: Any = None
        self.metrics_registry = CollectorRegistry()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.events.append("node.load")
        self.notifier.status("loading tiny 1/1")
        if self.fail_load:
            raise ModelLoadError("tiny: file is not GGUF")
        if self.hang_load:
            await trio.sleep_forever()
        task_status.started()
        await trio.sleep_forever()

    def mark_serving(self) -> None:
        self.events.append(f"node.serving armed={failpoints.REGISTRY._armed}")

    def begin_drain(self) -> None:
        self.events.append("node.drain")

    async def wait_idle(self, timeout: float | None = None) -> bool:
        with trio.move_on_after(float("inf") if timeout is None else timeout):
            if self.in_flight:
                await self.idle.wait()
            self.events.append("node.idle")
            return True
        return False

    async def unload_all(self) -> None:
        self.events.append("node.unload")


def _wiring(events: list[str], environ: dict[str, str], **node_kw: Any) -> daemon.Wiring:
    nodes: list[FakeNode] = []

    def make_node(config: NeuronConfig, *, identity: Any, gpus: Any, notifier: Any) -> FakeNode:
        node = FakeNode(events, **node_kw)
        node.notifier = notifier
        nodes.append(node)
        events.append(f"identity.starts={identity.starts}")
        return node

    async def serve_http(
        app: Any,
        config: NeuronConfig,
        *,
        shutdown_trigger: Callable[[], Awaitable[None]],
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        events.append("http.bound")
        task_status.started(["127.0.0.1:18080"])
        await shutdown_trigger()
        events.append("http.closed")

    wiring = daemon.Wiring(
        make_node=make_node,
        create_app=lambda node, config: object(),
        serve_http=serve_http,
        gpu_probe=NoGpu(),
        environ=environ,
        on_second_signal=lambda sig: events.append(f"hard-exit {sig}"),
    )
    wiring.nodes = nodes  # type: ignore[attr-defined]
    return wiring


@pytest.fixture
def config(tmp_path: Path) -> NeuronConfig:
    return config_from_mapping(
        {"node": {"state_dir": str(tmp_path / "state")}, "server": {"drain_timeout_s": 30}},
        origin="test",
        environ={},
    )


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    yield sock, {"NOTIFY_SOCKET": str(tmp_path / "notify")}
    sock.close()


def _received(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


@pytest.fixture(autouse=True)
def _reset_failpoints() -> Iterator[None]:
    yield
    failpoints.REGISTRY.configure({})


def _run_until_serving_then(
    d: daemon.Daemon, action: Callable[[daemon.Daemon], Awaitable[None]], clock: Any = None
) -> int:
    async def main() -> int:
        code = 0
        async with trio.open_nursery() as nursery:

            async def run_main() -> None:
                nonlocal code
                code = await d.main()

            nursery.start_soon(run_main)
            while d.phase != "serving":
                await trio.testing.wait_all_tasks_blocked()
            await action(d)
        return code

    return trio.run(main, clock=clock)


def test_start_ready_drain_exit_0(
    config: NeuronConfig, notify: tuple[socket.socket, dict[str, str]]
) -> None:
    sock, env = notify
    events: list[str] = []
    env = {**env, "NEURON_FAILPOINTS": "engine.step=hang"}
    daemon.configure_failpoints(env)
    d = daemon.Daemon(config, _wiring(events, env))

    async def sigterm(d: daemon.Daemon) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    assert _run_until_serving_then(d, sigterm) == 0
    assert events == [
        "identity.starts=1",
        "node.load",
        "http.bound",
        "node.serving armed=True",
        "node.drain",
        "node.idle",
        "http.closed",
        "node.unload",
    ]
    messages = _received(sock)
    ready = messages.index("READY=1\nSTATUS=serving on 127.0.0.1:18080")
    stopping = messages.index("STOPPING=1\nSTATUS=draining")
    assert "STATUS=loading tiny 1/1" in messages[:ready]
    assert ready < stopping and messages[-1] == "STATUS=stopped"
    assert d.phase == "stopped"
    assert not (config.state_path / "running").exists()  # a clean stop: the next start is not
    # an unexpected restart


def test_a_failed_start_leaves_the_next_start_unclean(config: NeuronConfig) -> None:
    assert daemon.run(config, _wiring([], {}, fail_load=True)) == 69
    assert (config.state_path / "running").exists()


def test_drain_waits_for_in_flight_up_to_the_timeout(config: NeuronConfig) -> None:
    events: list[str] = []
    wiring = _wiring(events, {})
    d = daemon.Daemon(config, wiring)
    clock = trio.testing.MockClock()

    async def drain_with_a_request(d: daemon.Daemon) -> None:
        node = wiring.nodes[0]  # type: ignore[attr-defined]
        node.in_flight = 1
        d.begin_drain(signal.SIGTERM)
        await trio.testing.wait_all_tasks_blocked()
        assert events[-1] == "node.drain" and d.phase == "draining"
        clock.jump(29.9)
        await trio.testing.wait_all_tasks_blocked()
        assert "http.closed" not in events  # still waiting for the request
        clock.jump(0.2)  # past drain_timeout_s = 30

    assert _run_until_serving_then(d, drain_with_a_request, clock) == 0
    assert events[-2:] == ["http.closed", "node.unload"] and "node.idle" not in events


def test_second_signal_exits_at_once(config: NeuronConfig) -> None:
    events: list[str] = []
    wiring = _wiring(events, {})
    d = daemon.Daemon(config, wiring)

    async def two_signals(d: daemon.Daemon) -> None:
        node = wiring.nodes[0]  # type: ignore[attr-defined]
        node.in_flight = 1  # the drain would wait
        os.kill(os.getpid(), signal.SIGTERM)
        while "node.drain" not in events:
            await trio.testing.wait_all_tasks_blocked()
            await trio.lowlevel.checkpoint()
        os.kill(os.getpid(), signal.SIGINT)
        while f"hard-exit {signal.SIGINT}" not in events:
            await trio.lowlevel.checkpoint()
        node.idle.set()

    assert _run_until_serving_then(d, two_signals) == 0
    assert f"hard-exit {signal.SIGINT}" in events


def test_signal_during_start_up(config: NeuronConfig) -> None:
    events: list[str] = []
    d = daemon.Daemon(config, _wiring(events, {}, hang_load=True))

    async def main() -> int:
        async with trio.open_nursery() as nursery:
            result: list[int] = []

            async def run_main() -> None:
                result.append(await d.main())

            nursery.start_soon(run_main)
            while "node.load" not in events:
                await trio.testing.wait_all_tasks_blocked()
            d.begin_drain(signal.SIGTERM)
        return result[0]

    assert trio.run(main) == 0
    assert "http.bound" not in events and events[-1] == "node.unload"


def test_default_model_failure_is_69(config: NeuronConfig) -> None:
    events: list[str] = []
    assert daemon.run(config, _wiring(events, {}, fail_load=True)) == 69


def test_bad_failpoints_is_78(config: NeuronConfig) -> None:
    assert daemon.run(config, _wiring([], {"NEURON_FAILPOINTS": "tp.nope=hang"})) == 78


def test_unwritable_state_dir_is_78(config: NeuronConfig, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    node = msgspec.structs.replace(config.node, state_dir=str(blocker / "state"))
    bad = msgspec.structs.replace(config, node=node)
    assert daemon.run(bad, _wiring([], {})) == 78


def test_bind_failure_is_71(config: NeuronConfig) -> None:
    wiring = _wiring([], {})

    async def cannot_bind(*args: Any, **kwargs: Any) -> None:
        raise OSError(98, "Address already in use")

    wiring.serve_http = cannot_bind
    assert daemon.run(config, wiring) == 71
