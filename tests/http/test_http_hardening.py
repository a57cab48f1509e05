"""The HTTP layer under a hostile or very busy client: real sockets, HTTP/2 frames from `h2`.

Each test drives the real app and hypercorn on 127.0.0.1 (tests/http/http_harness.py) and
fails without its fix (issue 11): the 1000-request cut, rapid reset, DATA after a response,
a trickled body, the connection limit, unbounded method labels, admin routes, a stream reset
before its body, deeply nested JSON.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import msgspec
import pytest
import trio

from neuron_trio.http import server as http_server
from neuron_trio.http.server import RateLimitFilter
from tests.http.fake_node import FakeNode
from tests.http.h2_frames import Frames
from tests.http.http_harness import chat_body, h1_client, h2_client, make_config, run, serving


def _doc(client: Frames, sid: int) -> Any:
    return msgspec.json.decode(bytes(client.data[sid]))


# --- 1. any number of requests on one HTTP/2 connection -------------------------------------


def test_an_h2_connection_carries_more_than_1000_requests_and_its_stream(tmp_path: Path) -> None:
    """hypercorn's keep_alive_max_requests (1000) sent GOAWAY and closed the socket, cutting
    the streams in flight; a router's connection must carry any number of requests."""
    node = FakeNode(tokens=("a", "b", "c"))
    release = trio.Event()

    async def gate(i: int) -> None:
        if i == 2:
            await release.wait()

    node.gate = gate

    async def body() -> None:
        async with serving(node) as srv:
            client = await Frames.open(srv.url)
            stream_sid = client.request(
                "POST",
                "/v1/chat/completions",
                body=msgspec.json.encode(chat_body(stream=True)),
            )
            await client.flush()
            await client.until(lambda: len(client.data[stream_sid]) > 0)
            total, batch, ok = 1100, 50, 0
            for _ in range(total // batch):
                sids = [client.request("GET", "/health") for _ in range(batch)]
                await client.flush()
                await client.until(lambda sids=sids: all(s in client.ended for s in sids))
                ok += sum(client.status.get(s) == 200 for s in sids)
            assert client.goaway is None and not client.closed
            assert ok == total
            release.set()  # the stream that was open all along finishes whole
            await client.until(lambda: stream_sid in client.ended)
            assert b"data: [DONE]" in client.data[stream_sid]
            assert stream_sid not in client.reset
            await client.aclose()

    run(body, timeout=120)


def test_rapid_reset_is_met_with_goaway_enhance_your_calm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_server, "H2_RESET_BURST", 20.0)
    monkeypatch.setattr(http_server, "H2_RESET_RATE_PER_S", 1.0)
    node = FakeNode()
    never = trio.Event()

    async def gate(i: int) -> None:
        await never.wait()

    node.gate = gate

    async def body() -> None:
        async with serving(node) as srv:
            client = await Frames.open(srv.url)
            for _ in range(60):
                sid = client.request(
                    "POST",
                    "/v1/chat/completions",
                    body=msgspec.json.encode(chat_body(stream=True)),
                )
                client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            await client.flush()
            await client.until(lambda: client.goaway is not None)
            assert client.goaway is not None
            assert client.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
            await client.aclose()
            # The server itself is fine.
            async with h2_client(srv.url) as other:
                assert (await other.get("/health")).status_code == 200

    run(body)


def test_a_few_resets_are_nothing_to_worry_about() -> None:
    node = FakeNode()

    async def body() -> None:
        async with serving(node) as srv:
            client = await Frames.open(srv.url)
            for _ in range(50):  # far below the burst
                sid = client.request("POST", "/v1/chat/completions", body=b"{}", end=False)
                client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            sid = client.request("GET", "/health")
            await client.flush()
            await client.until(lambda: sid in client.ended)
            assert client.status[sid] == 200 and client.goaway is None
            await client.aclose()

    run(body)


# --- 5. bounded discard, read timeout, connection limit ------------------------------------


def test_data_after_an_early_response_resets_the_stream_and_the_server_stays_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 401 client that keeps sending body: at most DISCARD_* is read, then RST_STREAM;
    before, hypercorn's KeyError on DATA for the ended stream stopped the whole server."""
    from neuron_trio.http.wire import body_discard

    monkeypatch.setattr(body_discard, "BEFORE_END_BYTES", 10_000)
    monkeypatch.setattr(body_discard, "AFTER_END_BYTES", 10_000)
    key = tmp_path / "key"
    key.write_text("k\n")

    async def body() -> None:
        async with serving(FakeNode(), make_config(api_key_file=str(key))) as srv:
            client = await Frames.open(srv.url)
            sid = client.request("POST", "/v1/chat/completions", body=b"x" * 16_000, end=False)
            await client.flush()
            await client.until(lambda: sid in client.ended)
            assert client.status[sid] == 401
            for _ in range(4):  # more body for an answered stream
                try:
                    client.conn.send_data(sid, b"y" * 8000)
                except h2.exceptions.StreamClosedError:
                    break
                await client.flush()
            await client.until(lambda: sid in client.reset)
            # NO_ERROR from the fix when hypercorn had dropped the stream; STREAM_CLOSED from
            # h2 itself when it had closed it too. Either way: reset, and the server is up.
            assert client.reset[sid] in (
                h2.errors.ErrorCodes.NO_ERROR,
                h2.errors.ErrorCodes.STREAM_CLOSED,
            )
            probe = client.request("GET", "/health")
            await client.flush()
            await client.until(lambda: probe in client.ended)
            assert client.status[probe] == 200
            await client.aclose()

    run(body)


def test_a_trickled_body_after_401_does_not_hold_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neuron_trio.http.wire import body_discard

    monkeypatch.setattr(body_discard, "BEFORE_END_TIMEOUT_S", 0.2)
    monkeypatch.setattr(body_discard, "AFTER_END_BYTES", 0)
    key = tmp_path / "key"
    key.write_text("k\n")

    async def body() -> None:
        async with serving(FakeNode(), make_config(api_key_file=str(key))) as srv:
            client = await Frames.open(srv.url)
            sid = client.request("POST", "/v1/chat/completions", body=b"x", end=False)
            await client.flush()
            # The body never ends: before, the 401 waited for it for ever.
            await client.until(lambda: sid in client.ended)
            assert client.status[sid] == 401
            # More of it now reaches a stream whose response has ended: hypercorn's KeyError
            # here stopped the whole server; now the stream is reset.
            client.conn.send_data(sid, b"y" * 100)
            await client.flush()
            await client.until(lambda: sid in client.reset)
            assert client.reset[sid] in (
                h2.errors.ErrorCodes.NO_ERROR,
                h2.errors.ErrorCodes.STREAM_CLOSED,
            )
            await client.aclose()
            async with h2_client(srv.url) as other:
                assert (await other.get("/health")).status_code == 200

    run(body, timeout=10)


def test_a_stalled_body_gets_408() -> None:
    async def body() -> None:
        async with serving(FakeNode(), make_config(read_timeout_s=0.3)) as srv:
            client = await Frames.open(srv.url)
            sid = client.request("POST", "/v1/chat/completions", body=b'{"mo', end=False)
            await client.flush()
            await client.until(lambda: sid in client.ended)
            assert client.status[sid] == 408
            assert _doc(client, sid)["error"]["code"] == "request_timeout"
            await client.aclose()

    run(body, timeout=10)


async def _answer(url: str, sent: bytes, *, close_after: bool) -> bytes:
    """What the server writes back on a raw HTTP/1.1 connection to `sent` (and the client's
    half close after it: it can still read), until the server closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(sent)
    if close_after:
        await stream.send_eof()
    got = bytearray()
    with trio.fail_after(10):
        while chunk := await stream.receive_some(65536):
            got += chunk
    await stream.aclose()
    return bytes(got)


def test_a_request_cut_off_by_the_clients_close_gets_no_answer() -> None:
    """Fix 8: hypercorn answered a request that the client's close cut off with a 400 that
    nobody reads (4,096 such connections closed at once kept the event loop ~1 s). Now the
    connection just ends; a malformed request the client did not cut off still gets its 400,
    and a whole request before the client's half close its answer."""

    async def body() -> None:
        async with serving(FakeNode(), make_config()) as srv:
            assert await _answer(srv.url, b"GET /hea", close_after=True) == b""
            malformed = await _answer(srv.url, b"NOT A REQUEST\r\n\r\n", close_after=False)
            assert malformed.startswith(b"HTTP/1.1 400 ")
            whole = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            assert (await _answer(srv.url, whole, close_after=True)).startswith(b"HTTP/1.1 200 ")

    run(body, timeout=30)


def test_connections_beyond_the_limit_are_closed_at_once() -> None:
    """Every connection busy (a stream in flight): one more is closed at once. (An idle one
    would make room instead: test_http_abuse.py.)"""
    node = FakeNode()
    release = trio.Event()
    generating = 0

    async def gate(i: int) -> None:
        nonlocal generating
        generating += 1
        await release.wait()

    node.gate = gate

    async def body() -> None:
        async with serving(node, make_config(max_connections=3)) as srv:
            accept_log = logging.getLogger("trio.serve_listeners")
            assert any(isinstance(f, RateLimitFilter) for f in accept_log.filters)
            held = [await Frames.open(srv.url) for _ in range(3)]
            for k, c in enumerate(held, 1):  # each is served, and busy
                c.request(
                    "POST", "/v1/chat/completions", body=msgspec.json.encode(chat_body(stream=True))
                )
                await c.flush()
                # a stream's headers wait for its first token: wait for the node instead
                with trio.fail_after(10):
                    while generating < k:
                        await trio.sleep(0.01)
            extra = await Frames.open(srv.url)
            with trio.fail_after(5):
                await extra.until(lambda: False)  # returns when the server closes it
            assert extra.closed and not extra.status
            await held[0].aclose()
            # The server closes it at once (before: only after keep_alive_timeout, 75 s), so a
            # new connection is served again within moments.
            served = None
            with trio.move_on_after(10):
                while served is None:
                    again = await Frames.open(srv.url)
                    sid = again.request("GET", "/health")
                    await again.flush()
                    await again.until(lambda again=again, sid=sid: sid in again.ended)
                    if again.status.get(sid) == 200:
                        served = again
                    else:
                        await again.aclose()
                        await trio.sleep(0.1)
            assert served is not None, "the closed connection still counts against the limit"
            release.set()
            for c in [*held[1:], served, extra]:
                await c.aclose()

    run(body)


def test_accept_errors_are_logged_once_per_interval_without_traceback() -> None:
    now = [0.0]
    limiter = RateLimitFilter(10.0, clock=lambda: now[0])
    logger = logging.getLogger("test.accept")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger.addHandler(Keep())
    logger.addFilter(limiter)
    logger.propagate = False
    try:
        for i in range(600):  # a minute of trio's 10-per-second EMFILE retries
            now[0] = i * 0.1
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                logger.error(
                    "accept returned %s (%s)", "EMFILE", "Too many open files", exc_info=True
                )
    finally:
        logger.removeFilter(limiter)
    assert len(records) == 6
    assert all(r.exc_info is None for r in records)
    assert "99 more like it" in records[1].getMessage()


# --- 4. bounded metric labels ----------------------------------------------------------------


def test_made_up_methods_share_one_label() -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv:
            client = await Frames.open(srv.url)
            sids = [client.request(f"X{i}", "/health") for i in range(200)]
            sids += [client.request("GET", f"/no/such/{i}") for i in range(50)]
            await client.flush()
            await client.until(lambda: all(s in client.ended for s in sids))
            await client.aclose()
            async with h2_client(srv.url) as http:
                text = (await http.get("/metrics")).text
            series = [
                line for line in text.splitlines() if line.startswith("neuron_http_requests_total{")
            ]
            methods = {line.split('method="')[1].split('"')[0] for line in series}
            routes = {line.split('route="')[1].split('"')[0] for line in series}
            assert methods <= {"GET", "other"}, methods
            assert len(series) <= 4, series
            assert "/no/such/1" not in routes

    run(body)


# --- 3. the admin key ------------------------------------------------------------------------


def test_admin_routes_need_the_admin_key(tmp_path: Path) -> None:
    user, admin = tmp_path / "api", tmp_path / "admin"
    user.write_text("user-key\n")
    admin.write_text("admin-key\n")
    config = make_config(api_key_file=str(user), admin_key_file=str(admin))
    spec = {"name": "m2", "source": "builtin:smollm2-135m"}
    node = FakeNode()

    async def body() -> None:
        async with serving(node, config) as srv, h2_client(srv.url) as http:

            def auth(key: str | None) -> dict[str, str]:
                return {"Authorization": f"Bearer {key}"} if key else {}

            assert (await http.post("/v1/models", json=spec)).status_code == 401
            r = await http.post("/v1/models", json=spec, headers=auth("user-key"))
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
            assert (
                await http.delete("/v1/models/fake-model", headers=auth("user-key"))
            ).status_code == 403
            assert (await http.delete("/v1/models/fake-model")).status_code == 401
            assert node.loaded == [] and node.unloaded == []
            r = await http.post("/v1/models", json=spec, headers=auth("admin-key"))
            assert r.status_code == 201
            assert (
                await http.delete("/v1/models/m2", headers=auth("admin-key"))
            ).status_code == 200
            # Everyone with a key may still use and list models; the admin key too.
            for key in ("user-key", "admin-key"):
                assert (await http.get("/v1/models", headers=auth(key))).status_code == 200
            r = await http.post("/v1/chat/completions", json=chat_body(), headers=auth("user-key"))
            assert r.status_code == 200

    run(body)


def test_admin_key_alone_leaves_other_routes_open(tmp_path: Path) -> None:
    admin = tmp_path / "admin"
    admin.write_text("admin-key\n")
    node = FakeNode()

    async def body() -> None:
        config = make_config(admin_key_file=str(admin))
        async with serving(node, config) as srv, h1_client(srv.url) as http:
            assert (await http.get("/v1/models")).status_code == 200
            r = await http.post("/v1/models", json={"name": "m2", "source": "x"})
            assert r.status_code == 401
            r = await http.post(
                "/v1/models",
                json={"name": "m2", "source": "x"},
                headers={"Authorization": "Bearer admin-key"},
            )
            assert r.status_code == 201

    run(body)


# --- 8. small ones ---------------------------------------------------------------------------


def test_a_stream_reset_before_its_body_is_a_499_without_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv:
            client = await Frames.open(srv.url)
            for _ in range(20):
                sid = client.request("POST", "/v1/chat/completions", body=b'{"mod', end=False)
                await client.flush()
                await trio.sleep(0.01)  # the app is waiting for the rest of the body
                client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                await client.flush()
            probe = client.request("GET", "/metrics")
            await client.flush()
            await client.until(lambda: probe in client.ended)
            text = bytes(client.data[probe]).decode()
            await client.aclose()
            counts = [
                line
                for line in text.splitlines()
                if line.startswith("neuron_http_requests_total{")
                and 'route="/v1/chat/completions"' in line
            ]
            assert counts and all('status="499"' in line for line in counts), counts

    with caplog.at_level(logging.INFO):
        run(body)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not [r for r in caplog.records if "unhandled" in r.getMessage()]


def test_deeply_nested_json_in_an_unknown_field_is_a_400() -> None:
    nested = b"[" * 100_000 + b"]" * 100_000
    doc = msgspec.json.encode(chat_body())[:-1] + b',"extra":' + nested + b"}"

    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as http:
            r = await http.post(
                "/v1/chat/completions", content=doc, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, r.text
            r = await http.post("/v1/models", content=b'{"name":"a","x":' + nested + b"}")
            assert r.status_code == 400, r.text

    run(body)


# --- 6. a cap on messages --------------------------------------------------------------------


def test_more_messages_than_max_messages_is_a_400() -> None:
    node = FakeNode()

    async def body() -> None:
        async with serving(node, make_config(max_messages=100)) as srv, h2_client(srv.url) as http:
            many = [{"role": "user", "content": ""}] * 101
            r = await http.post("/v1/chat/completions", json=chat_body(messages=many))
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "too_many_messages"
            assert r.json()["error"]["param"] == "messages"
            assert node.jobs == []
            r = await http.post("/v1/chat/completions", json=chat_body(messages=many[:100]))
            assert r.status_code == 200
            # the Responses API's input items become chat messages: the same cap
            items = [{"role": "user", "content": "x"}] * 101
            r = await http.post("/v1/responses", json={"model": "fake-model", "input": items})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "too_many_messages"

    run(body)
