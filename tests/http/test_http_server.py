"""serve_http: every listen address, h2c upgrade, graceful stop with a stream in flight."""

from __future__ import annotations

import socket

import httpx
import pytest
import trio

from neuron_trio.http import BoundAddress
from neuron_trio.http.server import hypercorn_config
from tests.http.fake_node import FakeNode
from tests.http.http_harness import (
    RawH2,
    chat_body,
    h1_client,
    h2_client,
    make_config,
    run,
    serving,
    sse_events,
)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_every_listen_address_is_bound_and_served() -> None:
    listen = ["127.0.0.1:0", "127.0.0.1:0"]
    if _has_ipv6_loopback():
        listen.append("[::1]:0")

    async def body() -> None:
        async with serving(FakeNode(), make_config(listen=listen)) as srv:
            assert len(srv.bound) == len(listen)
            # distinct sockets: an IPv4 and an IPv6 listener may be given the same port number
            assert len({(b.host, b.port) for b in srv.bound}) == len(listen)
            for bound in srv.bound:
                async with h2_client(bound.url) as client:
                    assert (await client.get("/health")).status_code == 200

    run(body)


def test_bound_address_parsing() -> None:
    assert BoundAddress.parse("http://127.0.0.1:8080") == BoundAddress("http", "127.0.0.1", 8080)
    v6 = BoundAddress.parse("https://[::1]:443")
    assert (v6.host, v6.port, v6.url, str(v6)) == (
        "::1",
        443,
        "https://[::1]:443",
        "https://[::1]:443",
    )
    with pytest.raises(ValueError):
        BoundAddress.parse("unix:/run/x.sock")


def test_hypercorn_settings_follow_the_config() -> None:
    hc = hypercorn_config(make_config(drain_timeout_s=42.0))
    assert hc.graceful_timeout == 42.0
    assert hc.bind == ["127.0.0.1:0"] and not hc.ssl_enabled


def test_h2c_upgrade_from_http1() -> None:
    import h2.config
    import h2.connection
    import h2.events

    async def body() -> None:
        async with serving(FakeNode()) as srv:
            bound = srv.bound[0]
            conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
            settings = conn.initiate_upgrade_connection()
            assert settings is not None
            stream = await trio.open_tcp_stream(bound.host, bound.port)
            async with stream:
                await stream.send_all(
                    b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                    b"Upgrade: h2c\r\nHTTP2-Settings: " + settings + b"\r\n\r\n"
                )
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await stream.receive_some(4096)
                head, _, rest = data.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 101"), head
                await stream.send_all(conn.data_to_send())
                status, body_bytes, ended = None, b"", False
                events = conn.receive_data(rest) if rest else []
                while not ended:
                    for event in events:
                        if isinstance(event, h2.events.ResponseReceived) and event.stream_id == 1:
                            status = dict(event.headers)[b":status"]
                        elif isinstance(event, h2.events.DataReceived) and event.stream_id == 1:
                            body_bytes += event.data
                        elif isinstance(event, h2.events.StreamEnded) and event.stream_id == 1:
                            ended = True
                    await stream.send_all(conn.data_to_send())
                    if not ended:
                        events = conn.receive_data(await stream.receive_some(65536))
                assert status == b"200"
                assert b'"status":"ok"' in body_bytes

    run(body)


@pytest.mark.parametrize("http2", [True, False])
def test_stop_lets_a_stream_in_flight_finish_and_refuses_new_connections(http2: bool) -> None:
    # HTTP/2 through the bare h2 client: httpcore fails every open stream on a graceful
    # GOAWAY (last_stream_id covers them), which hypercorn sends when it stops.
    async def body() -> None:
        node = FakeNode()
        release = trio.Event()

        async def gate(i: int) -> None:
            if i == 1:
                await release.wait()

        node.gate = gate

        async def refused(url: str) -> None:
            async with h1_client(url) as other:
                with pytest.raises(httpx.ConnectError):
                    await other.get("/health")

        async with serving(node, make_config(drain_timeout_s=30.0)) as server:
            bound, stop, done = server.bound, server.stop, server.done
            if http2:
                async with RawH2.connect(bound[0]) as raw:
                    sid = await raw.post("/v1/chat/completions", chat_body(stream=True))
                    assert b'"content":"Hello"' in await raw.read_until_data(sid)
                    stop.set()
                    await refused(bound[0].url)
                    release.set()
                    text = (await raw.read_until_ended(sid)).decode()
            else:
                async with (
                    h1_client(bound[0].url) as client,
                    client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r,
                ):
                    lines = r.aiter_lines()
                    async for line in lines:
                        if '"content":"Hello"' in line:
                            break
                    stop.set()
                    await refused(bound[0].url)
                    release.set()
                    text = "\n\n".join([line async for line in lines if line]) + "\n\n"
            events = sse_events(text[text.index("data: ") :])
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "stop"
            with trio.fail_after(10):
                await done.wait()

    run(body)
