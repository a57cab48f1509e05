"""Streaming over real connections: pacing, HTTP/2 multiplexing, disconnects, a fast drain.

Ordering comes from trio events the fake node waits on, never from sleeps.
"""

from __future__ import annotations

import httpx
import pytest
import trio

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

COMPLETION = {"model": "fake-model", "prompt": "x", "stream": True}


def test_first_chunk_arrives_before_the_last_is_produced() -> None:
    async def body() -> None:
        node = FakeNode()
        release = trio.Event()

        async def gate(i: int) -> None:
            if i >= 1:
                await release.wait()

        node.gate = gate
        async with serving(node) as srv, h2_client(srv.url) as client:
            async with client.stream("POST", "/v1/completions", json=COMPLETION) as r:
                assert r.http_version == "HTTP/2"
                lines = r.aiter_lines()
                first = await anext(lines)
                assert '"text":"Hello"' in first
                assert node.produced == 1  # the rest is not even produced yet
                release.set()
                rest = [line async for line in lines]
            assert node.produced == 4
            events = sse_events("\n".join([first, *rest]) + "\n")
            assert events[-1] == "[DONE]"

    run(body)


def test_eight_streams_share_one_http2_connection() -> None:
    async def body() -> None:
        node = FakeNode()
        streams = 8
        first_seen = 0
        all_started = trio.Event()

        async def gate(i: int) -> None:
            if i == 1:
                await all_started.wait()

        node.gate = gate
        results: dict[int, str] = {}
        limits = httpx.Limits(max_connections=1)
        async with serving(node) as srv, h2_client(srv.url, limits=limits) as client:

            async def one(k: int) -> None:
                nonlocal first_seen
                doc = chat_body(stream=True, messages=[{"role": "user", "content": f"stream {k}"}])
                async with client.stream("POST", "/v1/chat/completions", json=doc) as r:
                    assert r.http_version == "HTTP/2"
                    lines = r.aiter_lines()
                    async for line in lines:
                        if '"content":"Hello"' in line:
                            break
                    first_seen += 1
                    if first_seen == streams:
                        # every stream has its first token while none has its second
                        assert node.produced == streams
                        all_started.set()
                    # (httpcore reads for all streams under one lock: a stream that blocked
                    # reading now would keep the others from their buffered events)
                    await all_started.wait()
                    text = "".join([line async for line in lines])
                    assert text.endswith("data: [DONE]")
                    results[k] = text

            async with trio.open_nursery() as nursery:
                for k in range(streams):
                    nursery.start_soon(one, k)
        assert sorted(results) == list(range(streams))
        assert node.produced == 4 * streams
        assert len(node.jobs) == streams and node.closed_early == 0

    run(body)


CLIENTS = ["h2-reset-stream", "h2-close-connection", "http1-close-connection"]


def _stalling_node() -> FakeNode:
    """Produces its first event, then waits forever for the next."""
    node = FakeNode()
    never = trio.Event()

    async def gate(i: int) -> None:
        if i >= 1:
            await never.wait()

    node.gate = gate
    return node


@pytest.mark.parametrize("how", CLIENTS)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_client_that_goes_away_cancels_its_sequence(how: str, stream: bool) -> None:
    async def body() -> None:
        node = _stalling_node()
        doc = {"model": "fake-model", "prompt": "x", "stream": stream}
        async with serving(node) as srv:
            if how == "h2-reset-stream":
                async with RawH2.connect(srv.bound[0]) as raw:
                    sid = await raw.post("/v1/completions", doc)
                    if stream:
                        assert b'"text":"Hello"' in await raw.read_until_data(sid)
                    else:
                        await node.entered.wait()
                    await raw.reset(sid)
                    await node.exited.wait()
                    # the connection itself still serves
                    sid = await raw.post("/v1/completions", {**doc, "model": "nope"})
                    assert b"model_not_found" in await raw.read_until_data(sid)
            else:
                make = h2_client if how.startswith("h2") else h1_client
                async with make(srv.url) as client, trio.open_nursery() as nursery:

                    async def request() -> None:
                        async with client.stream("POST", "/v1/completions", json=doc) as r:
                            async for _ in r.aiter_bytes():
                                pass

                    nursery.start_soon(request)
                    await node.entered.wait()
                    nursery.cancel_scope.cancel()
                # the client and its connection are closed now
                await node.exited.wait()
            assert node.open == 0 and node.closed_early == 1
            async with h2_client(srv.url) as client:
                assert (await client.get("/health")).status_code == 200

    run(body)


def test_stop_with_idle_connections_after_streams_is_fast() -> None:
    """The shielded final send: a finished stream leaves no connection holding the drain."""

    async def body() -> None:
        node = FakeNode()
        async with serving(node, make_config(drain_timeout_s=60.0)) as server:
            bound, stop, done = server.bound, server.stop, server.done
            async with h2_client(bound[0].url) as c2, h1_client(bound[0].url) as c1:
                for client in (c2, c1):
                    r = await client.post("/v1/chat/completions", json=chat_body(stream=True))
                    assert sse_events(r.text)[-1] == "[DONE]"
                # both keep-alive connections are still open on the clients' side
                stop.set()
                with trio.fail_after(10):  # far below the 60 s drain timeout
                    await done.wait()

    run(body, timeout=30)
