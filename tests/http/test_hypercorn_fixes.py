"""hypercorn's fixes one by one: each fits the installed hypercorn, each does its one thing
(on doubles of the protocol, built from the method it replaces), and a fix whose shape check
fails stops the daemon with exit 78 before anything is installed. The fixes' end-to-end
behaviour is tested through real servers in test_http_hardening.py, test_http_abuse.py and
test_h2_writes.py."""

from __future__ import annotations

import functools
import logging
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import priority
import pytest
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Response, StreamClosed
from hypercorn.protocol.h2 import H2Protocol, StreamBuffer
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import EventWrapper, TrioSingleTask

from neuron_trio import daemon
from neuron_trio.config import config_from_mapping
from neuron_trio.http.wire import _hypercorn_fixes as fixes
from neuron_trio.http.wire import _hypercorn_floods as floods
from neuron_trio.http.wire import _hypercorn_h2 as h2_fixes
from neuron_trio.http.wire import body_discard
from neuron_trio.http.wire.connections import ConnectionTable
from neuron_trio.http.wire.h2_floods import NodeFloodBudget

ROOT = Path(__file__).resolve().parents[2]


def trio_test(fn: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    @functools.wraps(fn)
    def run() -> None:
        trio.run(fn)

    return run


def _fix(number: int) -> fixes.Fix:
    return next(f for f in fixes.FIXES if f.number == number)


def _patched(number: int, name: str, original: Any) -> Any:
    """Fix `number`'s replacement for `name`, built over `original` (not installed)."""
    patch = next(p for p in _fix(number).patches() if p.name == name)
    return patch.make(original)


class Calls:
    """An original method double: records what it was called with."""

    def __init__(self, result: Any = None, error: Exception | None = None) -> None:
        self.calls: list[Any] = []
        self.result = result
        self.error = error

    async def __call__(self, _self: Any, *args: Any) -> Any:
        self.calls.append(args)
        if self.error is not None:
            raise self.error
        return self.result


class FakeH2Connection:
    def __init__(self) -> None:
        self.streams: dict[int, Any] = {}
        self.did: list[tuple[str, Any]] = []

    def end_stream(self, stream_id: int) -> None:
        self.did.append(("end_stream", stream_id))

    def acknowledge_received_data(self, length: int, stream_id: int) -> None:
        self.did.append(("ack", length))

    def reset_stream(self, stream_id: int, code: Any) -> None:
        self.did.append(("reset", code))

    def close_connection(self, code: Any) -> None:
        self.did.append(("close", code))


async def _noop(*_args: Any) -> None:
    return None


def _h2_self(**kw: Any) -> SimpleNamespace:
    sent: list[Any] = []

    async def send(event: Any) -> None:
        sent.append(event)

    base: dict[str, Any] = {
        "closed": False,
        "stream_buffers": {},
        "streams": {},
        "connection": FakeH2Connection(),
        "config": SimpleNamespace(),
        "client": ("192.0.2.1", 1234),
        "priority": priority.PriorityTree(),
        "_flush": _noop,
        "send": send,
        "sent": sent,
    }
    base.update(kw)
    return SimpleNamespace(**base)


# --- the table as a whole ------------------------------------------------------------------------


def test_every_fix_fits_the_installed_hypercorn_and_is_installed() -> None:
    assert [(f.number, p) for f, p in fixes.shape_problems()] == []
    fixes.apply_hypercorn_fixes()
    for fix in fixes.FIXES:
        for patch in fix.patches():
            installed = getattr(patch.cls, patch.name)
            assert hasattr(installed, "__wrapped__") or patch.name.startswith("_neuron_"), (
                fix.number,
                patch.name,
            )
    assert [f.number for f in fixes.FIXES] == list(range(1, 9))


def test_hypercorn_is_pinned_to_the_minor_the_fixes_were_verified_on() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "hypercorn>=0.18.0,<0.19" in deps
    assert fixes.hypercorn_version().startswith("0.18.")


def _sync_error(self: Any, status_code: int) -> None:
    return None


async def _empty_send_data(self: Any, stream_id: int) -> None:
    return None


def _protocol_send_not_async(self: Any, event: Any) -> None:
    return None


# Each breaks one hypercorn shape that only that fix relies on.
BREAKS: dict[int, Any] = {
    1: lambda mp: mp.delattr(StreamBuffer, "complete"),
    2: lambda mp: mp.delattr(h2.connection.H2Connection, "acknowledge_received_data"),
    3: lambda mp: mp.delattr(priority.PriorityTree, "remove_stream"),
    4: lambda mp: mp.setattr(TCPServer, "protocol_send", _protocol_send_not_async),
    5: lambda mp: mp.delattr(TrioSingleTask, "stop"),
    6: lambda mp: mp.setattr(H2Protocol, "_send_data", _empty_send_data),
    7: lambda mp: mp.setattr(fixes, "FIXES", tuple(f for f in fixes.FIXES if f.number != 6)),
    8: lambda mp: mp.setattr(H11Protocol, "_send_error_response", _sync_error),
}


@pytest.mark.parametrize("number", sorted(BREAKS))
def test_a_fix_that_does_not_fit_refuses_to_apply_and_installs_nothing(
    number: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fixes, "_APPLIED", False)
    BREAKS[number](monkeypatch)
    send_task = H2Protocol.send_task
    with pytest.raises(fixes.HypercornFixError) as caught:
        fixes.apply_hypercorn_fixes()
    assert f"fix {number} (" in str(caught.value)
    assert f"hypercorn {fixes.hypercorn_version()}" in str(caught.value)
    assert H2Protocol.send_task is send_task  # nothing installed
    assert fixes._APPLIED is False


def test_the_daemon_exits_78_with_one_line_when_a_fix_does_not_fit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fixes, "_APPLIED", False)
    BREAKS[6](monkeypatch)
    config = config_from_mapping(
        {"node": {"state_dir": str(tmp_path / "state")}}, origin="test", environ={}
    )
    made: list[Any] = []
    wiring = daemon.Wiring(make_node=lambda *a, **k: made.append(a), environ={})
    with caplog.at_level(logging.ERROR):
        assert daemon.run(config, wiring) == 78
    assert made == []  # refused before any model loads
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "hypercorn 0.18" in errors[0] and "fix 6 (" in errors[0]


# --- each fix's own behaviour ------------------------------------------------------------------


@trio_test
async def test_fix_1_ends_a_complete_stream_before_its_close_is_handled() -> None:
    buffer = SimpleNamespace(complete=True)
    proto = _h2_self(stream_buffers={1: buffer})
    order: list[str] = []

    async def original(self: Any, event: Any) -> None:
        order.append(f"close after {proto.connection.did}")

    await _patched(1, "stream_send", original)(proto, StreamClosed(stream_id=1))
    assert order == ["close after [('end_stream', 1)]"]


def test_fix_2_drops_data_for_an_ended_stream_then_resets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(body_discard, "AFTER_END_BYTES", 10)
    proto = _h2_self()
    original = Calls()
    handle = _patched(2, "_handle_events", original)
    data = h2.events.DataReceived(stream_id=3)
    data.stream_id, data.data, data.flow_controlled_length = 3, b"x" * 8, 8
    trio.run(handle, proto, [data])  # hypercorn: KeyError on self.streams[3]
    assert proto.connection.did == [("ack", 8)]
    assert original.calls == [([],)]  # nothing for hypercorn, but its flush
    trio.run(handle, proto, [data])  # 16 bytes > 10: reset
    assert proto.connection.did[-1] == ("reset", h2.errors.ErrorCodes.NO_ERROR)


@trio_test
async def test_fix_2_an_error_response_lifts_the_content_length_check() -> None:
    stream = SimpleNamespace(_expected_content_length=1000)
    proto = _h2_self()
    proto.connection.streams[5] = stream
    original = Calls()
    await _patched(2, "stream_send", original)(proto, Response(5, [], 413))
    assert stream._expected_content_length is None and len(original.calls) == 1


def _flood_config() -> SimpleNamespace:
    return SimpleNamespace(
        h2_flood_budget=NodeFloodBudget(1000.0, 1000.0),
        h2_control_rate_per_s=1.0,
        h2_control_burst=5.0,
    )


@trio_test
async def test_fix_3_a_ping_flood_gets_enhance_your_calm() -> None:
    proto = _h2_self(config=_flood_config(), _neuron_control_frame=None)
    proto._neuron_control_frame = lambda event: floods._control_frame(proto, event)
    original = Calls()
    pings = [h2.events.PingReceived(ping_data=b"12345678") for _ in range(100)]
    await _patched(3, "_handle_events", original)(proto, pings)
    assert ("close", h2.errors.ErrorCodes.ENHANCE_YOUR_CALM) in proto.connection.did
    assert isinstance(proto.sent[-1], Closed)


@trio_test
async def test_fix_3_an_error_from_a_peers_frames_ends_only_its_connection() -> None:
    proto = _h2_self(_neuron_control_frame=lambda event: None)
    original = Calls(error=KeyError(7))
    await _patched(3, "_handle_events", original)(proto, [h2.events.WindowUpdated(stream_id=0)])
    assert ("close", h2.errors.ErrorCodes.INTERNAL_ERROR) in proto.connection.did
    assert isinstance(proto.sent[-1], Closed)


def _rapid_resets(count: int) -> bytes:
    """A client's preface, then `count` streams opened and reset, as one read would hold them."""
    client = h2.connection.H2Connection()
    client.initiate_connection()
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
               (":authority", "n")]  # fmt: skip
    for i in range(count):
        client.send_headers(1 + 2 * i, headers)
        client.reset_stream(1 + 2 * i, h2.errors.ErrorCodes.CANCEL)
    return client.data_to_send()


@trio_test
async def test_fix_3_a_read_is_parsed_in_slices_and_none_after_the_connection_closes() -> None:
    # hypercorn's handle over a real h2 server connection; the flood guard's part played by
    # closing it once 50 resets were seen. Whole, one read of 1,000 resets was parsed to the
    # end before any event was looked at.
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    resets: list[int] = []
    slices: list[int] = []

    async def original(self: Any, event: Any) -> None:
        slices.append(len(event.data))
        for e in self.connection.receive_data(event.data):
            if isinstance(e, h2.events.StreamReset):
                resets.append(e.stream_id)
                if len(resets) == 50:
                    self.connection.close_connection(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)

    data = _rapid_resets(1000)
    assert len(data) > 10 * floods.PARSE_SLICE_BYTES
    proto = _h2_self(connection=server)
    await _patched(3, "handle", original)(proto, RawData(data=data))
    assert max(slices) <= floods.PARSE_SLICE_BYTES
    # a rapid-reset stream is ~26 bytes: at most a slice's worth past the close
    assert 50 <= len(resets) <= 50 + floods.PARSE_SLICE_BYTES // 20 < 1000
    # an honest read is passed on whole, and other events untouched
    slices.clear()
    small = _h2_self(
        connection=h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    )
    await _patched(3, "handle", original)(small, RawData(data=_rapid_resets(3)))
    assert len(slices) == 1


@trio_test
async def test_fix_3_a_stream_reset_in_the_same_read_never_reaches_the_app() -> None:
    # A real server connection's events for one read: three streams opened and reset (one
    # with a body), then an honest request. Before, each reset stream was made (an app task,
    # a request started and cancelled, an access line) and closed again.
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    client = h2.connection.H2Connection()
    client.initiate_connection()
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
               (":authority", "n")]  # fmt: skip
    for stream_id in (1, 3, 5):
        client.send_headers(stream_id, headers)
        if stream_id == 3:
            client.send_data(stream_id, b"x" * 100)
        client.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
    client.send_headers(7, headers, end_stream=True)
    events = server.receive_data(client.data_to_send())
    acked: list[tuple[int, int]] = []
    acknowledge = server.acknowledge_received_data
    server.acknowledge_received_data = lambda n, sid: (acked.append((n, sid)), acknowledge(n, sid))  # type: ignore[method-assign]
    proto = _h2_self(connection=server, _neuron_control_frame=lambda event: None)
    original = Calls()
    await _patched(3, "_handle_events", original)(proto, events)
    handed = [e for (batch,) in original.calls for e in batch]
    assert [e.stream_id for e in handed if isinstance(e, h2.events.RequestReceived)] == [7]
    assert [e.stream_id for e in handed if isinstance(e, h2.events.StreamReset)] == [1, 3, 5]
    assert not [e for e in handed if isinstance(e, h2.events.DataReceived)]
    assert acked == [(100, 3)]  # the skipped body's bytes still earn the connection's window


@trio_test
async def test_fix_3_a_reset_streams_empty_data_frames_still_count_against_the_budget() -> None:
    # skipped with their stream, but an empty DATA frame is a control frame all the same
    proto = _h2_self(config=_flood_config(), _neuron_control_frame=None)
    proto._neuron_control_frame = lambda event: floods._control_frame(proto, event)
    empty = [h2.events.DataReceived(stream_id=1, data=b"", flow_controlled_length=0)] * 50
    reset = h2.events.StreamReset(stream_id=1, error_code=h2.errors.ErrorCodes.CANCEL)
    await _patched(3, "_handle_events", Calls())(proto, [*empty, reset])
    assert ("close", h2.errors.ErrorCodes.ENHANCE_YOUR_CALM) in proto.connection.did


class FakeStream:
    def __init__(self) -> None:
        self.closed = False
        self.socket = SimpleNamespace(getpeername=lambda: ("192.0.2.9", 1))

    async def aclose(self) -> None:
        self.closed = True


@trio_test
async def test_fix_4_a_connection_past_the_table_is_closed_at_once() -> None:
    table = ConnectionTable(limit=1, per_peer=1)
    table.busy(table.enter("192.0.2.9").entry)  # type: ignore[arg-type]
    stream = FakeStream()
    server = SimpleNamespace(config=SimpleNamespace(connection_table=table), stream=stream)
    original = Calls()
    await _patched(4, "run", original)(server)
    assert stream.closed and original.calls == [] and table.refused == 1


@trio_test
async def test_fix_4_updates_mark_the_connection_busy_then_idle() -> None:
    table = ConnectionTable(limit=4, per_peer=4)
    entry = table.enter("192.0.2.9").entry
    server = SimpleNamespace(config=SimpleNamespace(connection_table=table), _neuron_conn=entry)
    send = _patched(4, "protocol_send", Calls())
    await send(server, Updated(idle=False))
    assert table.busy_count == 1
    await send(server, Updated(idle=True))
    assert table.busy_count == 0


@trio_test
async def test_fix_5_once_the_peer_is_gone_the_idle_timer_returns_at_once() -> None:
    stopped: list[bool] = []

    async def stop() -> None:
        stopped.append(True)

    server = SimpleNamespace(idle_task=SimpleNamespace(stop=stop))
    idle_original = Calls()
    idle = _patched(5, "_idle_timeout", idle_original)
    await idle(server)
    assert len(idle_original.calls) == 1  # the peer is there: hypercorn's keep-alive wait
    await _patched(5, "_read_data", Calls())(server)
    await idle(server)
    assert stopped == [True] and len(idle_original.calls) == 1


@trio_test
async def test_fix_6_and_7_frames_without_a_write_and_earns_window_credit() -> None:
    buffer = StreamBuffer(EventWrapper)
    await buffer.push(b"token")
    sent: list[bytes] = []
    connection = SimpleNamespace(
        local_flow_control_window=lambda sid: 1000,
        max_outbound_frame_size=1000,
        send_data=lambda sid, data: sent.append(data),
    )
    proto = _h2_self(stream_buffers={1: buffer}, connection=connection, _flush=None)
    proto.priority.insert_stream(1)
    frame = _patched(7, "_neuron_frame_data", h2_fixes._frame_data)
    assert await frame(proto, 1) == 5  # framed; no _flush (None would raise if called)
    assert sent == [b"token"] and proto._neuron_wu_credit == 2
    classify = _patched(7, "_neuron_control_frame", floods._control_frame)
    update = h2.events.WindowUpdated(stream_id=0)
    assert classify(proto, update) is None and classify(proto, update) is None
    assert classify(proto, update) is not None  # the third is counted


@trio_test
async def test_fix_8_a_request_cut_off_by_eof_gets_no_400() -> None:
    proto = SimpleNamespace()
    error = Calls()
    await _patched(8, "handle", Calls())(proto, RawData(b""))
    await _patched(8, "_send_error_response", error)(proto, 400)
    assert error.calls == []
