"""Issue 25 (#7, #9, #11): connection hogs, HTTP/2 control-frame floods, an early 413 over
HTTP/2, and a client's reset counted as a server error.

Each test fails on the code before its fix; the server tests drive the real app and hypercorn
on 127.0.0.1 (tests/http/http_harness.py) with frames from `h2` (tests/http/h2_frames.py).
"""

from __future__ import annotations

from typing import Any

import h2.errors
import h2.events
import httpx
import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from neuron_trio.http import server as http_server
from neuron_trio.http.metrics import http_metrics
from neuron_trio.http.middleware import NeuronMiddleware
from neuron_trio.http.wire.connections import ConnectionTable
from neuron_trio.http.wire.h2_floods import (
    ControlFrame,
    FloodGuard,
    FloodVerdict,
    NodeFloodBudget,
    TokenBucket,
)
from tests.http.fake_node import FakeNode
from tests.http.h2_frames import Frames
from tests.http.http_harness import chat_body, h2_client, make_config, run, serving

BIG = 3_000_000  # a chat body three times server.max_body_bytes


def _big_chat() -> bytes:
    return msgspec.json.encode(
        chat_body(messages=[{"role": "user", "content": "x" * BIG}]),
    )


# --- 11. an early 413 over HTTP/2 is read cleanly -------------------------------------------


@pytest.mark.parametrize("chunked", [False, True])
def test_an_oversized_body_over_h2_gets_a_clean_413(chunked: bool) -> None:
    """httpx sends the whole body before reading: the server reset the stream after its 413
    and httpx raised a protocol error instead of returning the 413."""
    body = _big_chat()

    async def pieces() -> Any:
        for i in range(0, len(body), 1 << 14):
            yield body[i : i + (1 << 14)]

    async def main() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            response = await client.post(
                "/v1/chat/completions", content=pieces() if chunked else body
            )
            assert response.status_code == 413
            assert response.json()["error"]["code"] == "request_too_large"
            # the same connection goes on serving
            assert (await client.get("/health")).status_code == 200

    run(main, timeout=60)


def test_a_client_that_stops_its_body_after_a_413_reads_it_whole() -> None:
    """curl stops sending when it sees the 413's headers and ends the stream short of its
    content-length: h2 called that a connection error (GOAWAY PROTOCOL_ERROR), so curl never
    read the 413's body (exit 18)."""

    async def main() -> None:
        async with serving(FakeNode()) as srv:
            client = await Frames.open(srv.url)
            sid = client.conn.get_next_available_stream_id()
            headers = [(":method", "POST"), (":path", "/v1/chat/completions")]
            headers += [(":scheme", "http"), (":authority", client.authority)]
            headers += [("content-type", "application/json"), ("content-length", str(BIG))]
            client.conn.send_headers(sid, headers)
            for _ in range(3):
                client.conn.send_data(sid, b"x" * 16_000)
            client.data[sid] = bytearray()
            await client.flush()
            await client.until(lambda: sid in client.status)
            assert client.status[sid] == 413
            client.conn.end_stream(sid)  # what curl does: stop, and end the stream short
            await client.flush()
            await client.until(lambda: sid in client.ended or sid in client.reset)
            assert client.goaway is None, client.goaway
            assert msgspec.json.decode(bytes(client.data[sid]))["error"]["code"] == (
                "request_too_large"
            )
            probe = client.request("GET", "/health")
            await client.flush()
            await client.until(lambda: probe in client.ended)
            assert client.status[probe] == 200
            await client.aclose()

    run(main, timeout=60)


def test_a_client_disconnect_inside_an_exception_group_is_a_499_not_a_500() -> None:
    """A ClientDisconnect raised inside a task group reaches the middleware as an exception
    group, which Starlette's handler for ClientDisconnect misses: it was answered and counted
    as a 500 (one of 200 resets, in /metrics)."""
    registry = CollectorRegistry()
    metrics = http_metrics(registry)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        from starlette.requests import ClientDisconnect

        message = await receive()
        assert message["type"] == "http.disconnect"
        raise BaseExceptionGroup("task group", [ClientDisconnect()])

    middleware = NeuronMiddleware(
        app, metrics=metrics, route_of=lambda scope: "/v1/chat/completions", max_body_bytes=100
    )
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    scope["http_version"] = "2"
    trio.run(middleware, scope, receive, send)
    assert not sent  # nothing to answer: the client is gone
    labels = {"route": "/v1/chat/completions", "method": "POST"}
    assert registry.get_sample_value("neuron_http_requests_total", {**labels, "status": "499"})
    assert not registry.get_sample_value("neuron_http_requests_total", {**labels, "status": "500"})


# --- 9. HTTP/2 control-frame floods ---------------------------------------------------------


def test_a_token_bucket_refills_with_trio_time() -> None:
    async def main() -> None:
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, trio.testing.MockClock)
        bucket = TokenBucket(rate=2.0, burst=3.0)
        assert [bucket.take(trio.current_time()) for _ in range(4)] == [True] * 3 + [False]
        clock.jump(1.0)  # two more tokens
        assert [bucket.take(trio.current_time()) for _ in range(3)] == [True, True, False]
        clock.jump(100.0)  # never more than the burst
        assert sum(bucket.take(trio.current_time()) for _ in range(10)) == 3

    trio.run(main, clock=trio.testing.MockClock())


def _guard(node: NodeFloodBudget, **kw: float) -> FloodGuard:
    args = dict(rate=1.0, burst=10.0, reset_rate=1.0, reset_burst=10.0, grace=3.0)
    args.update(kw)
    return FloodGuard(node, **args)


def test_one_connection_flooding_is_stopped_by_its_own_budget() -> None:
    node = NodeFloodBudget(rate=1000.0, burst=1000.0)
    guard = _guard(node)
    verdicts = [guard.spend(ControlFrame.PING, 0.0) for _ in range(11)]
    assert verdicts[:10] == [FloodVerdict.OK] * 10
    assert verdicts[10] is FloodVerdict.CONNECTION_OVER_BUDGET
    # Resets have their own bucket: a connection's PINGs do not spend its resets.
    assert _guard(node).spend(ControlFrame.RESET, 0.0) is FloodVerdict.OK


def test_many_connections_meet_the_node_budget_but_a_quiet_one_is_spared() -> None:
    """50 connections each under their own limit: the node's budget stops them; a router that
    resets a stream now and then (under `grace`) is never the one closed."""
    node = NodeFloodBudget(rate=0.0, burst=100.0, reset_rate=0.0, reset_burst=100.0)
    floods = [_guard(node, reset_burst=1000.0) for _ in range(50)]
    router = _guard(node)
    closed = set()
    for _ in range(40):  # 50 x 40 = 2,000 resets: 20x the node's burst
        for i, guard in enumerate(floods):
            if i not in closed and guard.spend(ControlFrame.RESET, 0.0) is not FloodVerdict.OK:
                closed.add(i)
    assert closed == set(range(50))
    assert sum(sum(g.counts.values()) for g in floods) < 100 + 50 * 5  # not 2,000
    assert node.closed_connections == 50
    assert [router.spend(ControlFrame.RESET, 0.0) for _ in range(3)] == [FloodVerdict.OK] * 3


def _cheap_floods(monkeypatch: pytest.MonkeyPatch, **values: float) -> None:
    defaults = dict(
        H2_CONTROL_BURST=100.0,
        H2_CONTROL_RATE_PER_S=0.001,
        H2_NODE_BURST=100_000.0,
        H2_NODE_RATE_PER_S=0.001,
        H2_NODE_RESET_BURST=100_000.0,
        H2_NODE_RESET_RATE_PER_S=0.001,
    )
    defaults.update(values)
    for name, value in defaults.items():
        monkeypatch.setattr(http_server, name, value)


@pytest.mark.parametrize("frame", ["ping", "settings", "empty_data", "window_update"])
def test_a_control_frame_flood_gets_goaway_enhance_your_calm(
    monkeypatch: pytest.MonkeyPatch, frame: str
) -> None:
    """Before: 500,000 PINGs and 200,000 SETTINGS frames were all answered."""
    _cheap_floods(monkeypatch)

    async def main() -> None:
        async with serving(FakeNode()) as srv:
            client = await Frames.open(srv.url)
            sid = client.request("POST", "/v1/chat/completions", body=b"{", end=False)
            for i in range(1000):
                if frame == "ping":
                    client.conn.ping(i.to_bytes(8, "big"))
                elif frame == "settings":
                    client.conn.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0})
                elif frame == "empty_data":
                    client.conn.send_data(sid, b"")
                else:
                    client.conn.increment_flow_control_window(1)
                if i % 50 == 0:
                    await client.flush()
            await client.flush()
            await client.until(lambda: client.goaway is not None)
            # GOAWAY ENHANCE_YOUR_CALM, then the socket closes (which may lose the GOAWAY to a
            # TCP reset while the flood is still unread); before, every frame was answered.
            assert client.closed or client.goaway is not None
            if client.goaway is not None:
                assert client.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
            await client.aclose()
            async with h2_client(srv.url) as other:  # the server is fine
                assert (await other.get("/health")).status_code == 200

    run(main)


def test_an_honest_client_stays_under_the_control_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client reading long responses acknowledges their data with WINDOW_UPDATE: never
    counted, since DATA went out before each."""
    _cheap_floods(monkeypatch, H2_CONTROL_BURST=5.0)
    node = FakeNode(tokens=tuple("x" * 2000 for _ in range(200)))  # ~400 KB a response

    async def main() -> None:
        async with serving(node) as srv:
            client = await Frames.open(srv.url)
            for _ in range(3):
                sid = client.request(
                    "POST",
                    "/v1/chat/completions",
                    body=msgspec.json.encode(chat_body(stream=True)),
                )
                await client.flush()
                await client.until(lambda sid=sid: sid in client.ended)
                assert client.status[sid] == 200
            assert client.goaway is None and not client.closed
            await client.aclose()

    run(main, timeout=60)


def test_many_connections_resetting_meet_the_node_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: only a per-connection limit, so 50 connections x 1,000 resets all ran."""
    _cheap_floods(monkeypatch, H2_NODE_RESET_BURST=200.0)
    monkeypatch.setattr(http_server, "H2_RESET_BURST", 10_000.0)
    monkeypatch.setattr(http_server, "H2_FLOOD_GRACE", 10.0)

    async def main() -> None:
        async with serving(FakeNode()) as srv:
            clients = [await Frames.open(srv.url) for _ in range(10)]
            for client in clients:
                for _ in range(100):
                    sid = client.request("POST", "/v1/chat/completions", body=b"{", end=False)
                    client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                await client.flush()
            calmed = 0
            for i, client in enumerate(clients):
                # The first two may spend the node's 200 between them; every later one is
                # closed once it has spent its grace (10) with the node's budget gone.
                with trio.move_on_after(2 if i < 2 else 50):
                    await client.until(lambda client=client: client.goaway is not None)
                if client.goaway is not None:
                    assert client.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
                calmed += client.closed or client.goaway is not None
                await client.aclose()
            # 1,000 resets against a node budget of 200: most connections were closed, though
            # none went past its own (10,000) budget.
            assert calmed >= 8
            async with h2_client(srv.url) as other:
                assert (await other.get("/health")).status_code == 200

    run(main, timeout=60)


# --- 7. connections: per peer, and eviction of idle ones -----------------------------------


def test_the_table_evicts_fresh_connections_first_then_idle_ones_never_busy_ones() -> None:
    table = ConnectionTable(limit=3, per_peer=3)
    router = table.enter("10.0.0.1").entry
    assert router is not None
    table.busy(router)
    idle = table.enter("10.0.0.2").entry
    assert idle is not None
    table.busy(idle)
    table.idle(idle)  # one request completed
    hog = table.enter("10.0.0.3").entry
    first = table.enter("10.0.0.4")  # full: the hog (never a request) goes first
    assert first.entry is not None and first.victim is hog
    second = table.enter("10.0.0.5")  # then the fresh one just admitted, oldest first
    assert second.victim is first.entry
    table.busy(second.entry)  # type: ignore[arg-type]
    third = table.enter("10.0.0.6")  # then the idle one
    assert third.victim is idle
    table.busy(third.entry)  # type: ignore[arg-type]
    refused = table.enter("10.0.0.7")  # all busy: refused, the router untouched
    assert refused.entry is None and refused.victim is None
    assert table.open == 3 and not router.gone and table.evicted == 3 and table.refused == 1


def test_the_table_bounds_connections_per_peer() -> None:
    table = ConnectionTable(limit=100, per_peer=2)
    a, b = table.enter("1.2.3.4"), table.enter("1.2.3.4")
    assert a.entry and b.entry
    assert table.enter("1.2.3.4").entry is None  # a third from the same address
    assert table.enter("5.6.7.8").entry is not None  # another address is fine
    table.leave(a.entry)
    table.leave(a.entry)  # idempotent
    assert table.peer_count("1.2.3.4") == 1
    assert table.enter("1.2.3.4").entry is not None


async def _one_byte_connection(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"P")  # the start of a request, never finished
    return stream


async def _closed_by_server(stream: trio.SocketStream) -> bool:
    with trio.move_on_after(5):
        try:
            return await stream.receive_some(100) == b""
        except trio.BrokenResourceError:
            return True
    return False


def test_one_byte_connections_do_not_lock_out_other_clients_or_the_router() -> None:
    """Before: sockets that sent one byte each filled max_connections and every other client
    was refused until the idle timeout (75 s)."""
    node = FakeNode(tokens=("a", "b", "c"))
    release = trio.Event()

    async def gate(i: int) -> None:
        if i == 1:
            await release.wait()

    node.gate = gate

    async def main() -> None:
        config = make_config(max_connections=6, max_connections_per_peer=100)
        async with serving(node, config) as srv:
            router = await Frames.open(srv.url)
            sid = router.request(
                "POST", "/v1/chat/completions", body=msgspec.json.encode(chat_body(stream=True))
            )
            await router.flush()
            await router.until(lambda: len(router.data[sid]) > 0)  # streaming, held open
            hogs = [await _one_byte_connection(srv.url) for _ in range(5)]
            # The node is full; new clients still get answers, each in place of a hog.
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as other:
                for _ in range(3):
                    assert (await other.get("/health")).status_code == 200
            assert await _closed_by_server(hogs[0])
            release.set()
            await router.until(lambda: sid in router.ended)
            assert b"data: [DONE]" in router.data[sid] and sid not in router.reset
            for hog in hogs:
                await hog.aclose()
            await router.aclose()

    run(main, timeout=60)


def test_connections_from_one_address_beyond_its_limit_are_closed_at_once() -> None:
    async def main() -> None:
        config = make_config(max_connections=100, max_connections_per_peer=3)
        async with serving(FakeNode(), config) as srv:
            hogs = [await _one_byte_connection(srv.url) for _ in range(3)]
            extra = await _one_byte_connection(srv.url)
            assert await _closed_by_server(extra)
            for hog in hogs:
                await hog.aclose()
            await extra.aclose()

    run(main)


def test_resets_beyond_a_thousand_streams_on_one_connection_do_not_stop_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream reset before any response kept its priority-tree entry for the connection's
    life; the 1,001st made hypercorn raise TooManyStreamsError into the listener's nursery and
    the whole daemon exited (found by bench/attack_drill.py: 1,000 resets, then one more)."""
    _cheap_floods(monkeypatch)
    monkeypatch.setattr(http_server, "H2_RESET_BURST", 100_000.0)

    async def main() -> None:
        async with serving(FakeNode()) as srv:
            client = await Frames.open(srv.url)
            for i in range(1200):
                sid = client.request("POST", "/v1/chat/completions", body=None, end=False)
                client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                if i % 100 == 99:
                    await client.flush()
            probe = client.request("GET", "/health")
            await client.flush()
            await client.until(lambda: probe in client.ended)
            assert client.status[probe] == 200 and client.goaway is None
            await client.aclose()

    run(main, timeout=60)


def test_connections_resetting_at_their_own_sustained_rate_meet_the_node_budget() -> None:
    """Issue 47: each connection resetting at its own sustained rate keeps its bucket full, so
    the node's rule (spent more than `grace`) never picked any: 50 connections x 100 resets a
    second ran on forever. A router resetting a stream a second is still never closed."""
    node = NodeFloodBudget(rate=200.0, burst=500.0, reset_rate=200.0, reset_burst=500.0)
    floods = [_guard(node, reset_rate=100.0, reset_burst=1000.0, grace=20.0) for _ in range(50)]
    router = _guard(node, reset_rate=100.0, reset_burst=1000.0, grace=20.0)
    open_ = set(range(50))
    sent = 0
    for tick in range(1000):  # 10 s, every 10 ms: one reset per connection (100/s each)
        now = tick / 100
        for i in list(open_):
            sent += 1
            if floods[i].spend(ControlFrame.RESET, now) is not FloodVerdict.OK:
                open_.discard(i)
        if tick % 100 == 0:
            assert router.spend(ControlFrame.RESET, now) is FloodVerdict.OK
    assert len(open_) <= 2  # what the node's own rate (200/s) affords goes on
    assert sent < 4_000  # was 50,000: every reset of every connection
