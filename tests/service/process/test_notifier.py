"""sd_notify against a real unix datagram socket; the watchdog pinger under MockClock."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from neuron_trio.service.process.notifier import Notifier, watchdog_interval_s


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()


def _drain(sock: socket.socket) -> list[str]:
    sock.setblocking(False)
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_messages_arrive_in_order(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.status("loading smollm2-135m\n50%")
    assert n.ready("serving on 127.0.0.1:8080")
    assert n.watchdog()
    assert n.stopping("draining")
    assert _drain(sock) == [
        "STATUS=loading smollm2-135m 50%",
        "READY=1\nSTATUS=serving on 127.0.0.1:8080",
        "WATCHDOG=1",
        "STOPPING=1\nSTATUS=draining",
    ]
    n.close()


def test_abstract_socket() -> None:
    name = f"neuron-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(100) == b"READY=1"
    finally:
        sock.close()


def test_no_socket_is_a_no_op() -> None:
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval_s is None
    assert not n.ready() and not n.status("x") and not n.stopping() and not n.watchdog()


def test_vanished_socket_does_not_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert not n.ready() and not n.status("x")
    assert caplog.text.count("sd_notify") == 1  # logged once, not per message


def test_watchdog_interval() -> None:
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "junk"}) is None
    assert watchdog_interval_s({}) is None
    mine = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval_s(mine) == 1.0
    assert watchdog_interval_s({**mine, "WATCHDOG_PID": "1"}) is None


def test_pings_at_half_the_watchdog_interval(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    clock = trio.testing.MockClock()
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(n.run)
            await trio.testing.wait_all_tasks_blocked()
            assert n.sent == ["WATCHDOG=1"]  # one at once
            clock.jump(14.9)
            await trio.testing.wait_all_tasks_blocked()
            assert len(n.sent) == 1
            clock.jump(0.1)
            await trio.testing.wait_all_tasks_blocked()
            assert len(n.sent) == 2
            clock.jump(15 * 3)
            await trio.testing.wait_all_tasks_blocked()
            assert len(n.sent) == 3  # a stalled clock jump is one late ping, not a burst
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    assert _drain(sock) == ["WATCHDOG=1"] * 3


def test_no_watchdog_no_pings(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    clock = trio.testing.MockClock(autojump_threshold=0)
    n = Notifier({"NOTIFY_SOCKET": path})

    async def main() -> None:
        with trio.move_on_after(3600):
            await n.run()

    trio.run(main, clock=clock)
    assert n.sent == []
