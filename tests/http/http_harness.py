"""Run the real app and server on 127.0.0.1, port 0, inside a test's trio.run."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import trio

from neuron_trio.config import NeuronConfig, ServerConfig
from neuron_trio.http import BoundAddress, create_app, serve_http

TEST_TIMEOUT_S = 30.0


def run(fn: Callable[[], Awaitable[Any]], timeout: float = TEST_TIMEOUT_S) -> None:
    """trio.run a test body, failing (not hanging) if it takes longer than `timeout`."""

    async def main() -> None:
        with trio.fail_after(timeout):
            await fn()

    trio.run(main)


def make_config(**server: Any) -> NeuronConfig:
    server.setdefault("listen", ["127.0.0.1:0"])
    server.setdefault("drain_timeout_s", 2.0)
    return NeuronConfig(server=ServerConfig(**server))


@dataclass
class Running:
    bound: list[BoundAddress]
    stop: trio.Event  # set: the server drains and stops
    done: trio.Event  # set once serve_http has returned

    @property
    def url(self) -> str:
        return self.bound[0].url


@asynccontextmanager
async def serving(node: Any, config: NeuronConfig | None = None) -> AsyncIterator[Running]:
    """The real app over `node`, served until the block ends or the test sets `stop`."""
    config = config or make_config()
    app = create_app(node, config)
    stop, done = trio.Event(), trio.Event()

    async def serve(task_status: trio.TaskStatus[list[BoundAddress]]) -> None:
        try:
            await serve_http(app, config, shutdown_trigger=stop.wait, task_status=task_status)
        finally:
            done.set()

    async with trio.open_nursery() as nursery:
        bound = await nursery.start(serve)
        try:
            yield Running(bound, stop, done)
        finally:
            stop.set()


@asynccontextmanager
async def serving_node(node: Any, config: NeuronConfig) -> AsyncIterator[str]:
    """A real Node run and served as the daemon does; yields the base URL once serving."""
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        async with serving(node, config) as running:
            node.mark_serving()
            yield running.url
        nursery.cancel_scope.cancel()


def h2_client(base_url: str, **kw: Any) -> httpx.AsyncClient:
    """A cleartext HTTP/2 (prior knowledge) client."""
    return httpx.AsyncClient(base_url=base_url, http1=False, http2=True, timeout=10.0, **kw)


def h1_client(base_url: str, **kw: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, timeout=10.0, **kw)


def sse_events(raw: str) -> list[Any]:
    """The `data:` payloads of an SSE body, decoded (the `[DONE]` marker as the string)."""
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        out.append(payload if payload == "[DONE]" else msgspec.json.decode(payload))
    return out


def chat_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    body.update(extra)
    return body


class RawH2:
    """A bare HTTP/2 client (the `h2` library over a trio socket) that can reset one stream.

    httpx never sends RST_STREAM when a response is closed early; routers do.
    """

    def __init__(self, stream: trio.SocketStream, authority: str) -> None:
        import h2.config
        import h2.connection

        self.stream = stream
        self.authority = authority
        self.conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
        self.data: dict[int, bytearray] = {}
        self.ended: set[int] = set()

    @classmethod
    @asynccontextmanager
    async def connect(cls, bound: BoundAddress) -> AsyncIterator[RawH2]:
        stream = await trio.open_tcp_stream(bound.host, bound.port)
        async with stream:
            client = cls(stream, f"{bound.host}:{bound.port}")
            client.conn.initiate_connection()
            await client.flush()
            yield client

    async def flush(self) -> None:
        await self.stream.send_all(self.conn.data_to_send())

    async def post(self, path: str, doc: Any) -> int:
        sid: int = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":path", path),
            (":scheme", "http"),
            (":authority", self.authority),
            ("content-type", "application/json"),
        ]
        self.conn.send_headers(sid, headers)
        self.conn.send_data(sid, msgspec.json.encode(doc), end_stream=True)
        self.data[sid] = bytearray()
        await self.flush()
        return sid

    async def _receive(self) -> None:
        import h2.events

        raw = await self.stream.receive_some(65536)
        assert raw, "connection closed"
        for event in self.conn.receive_data(raw):
            if isinstance(event, h2.events.DataReceived):
                self.data.setdefault(event.stream_id, bytearray()).extend(event.data)
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                self.ended.add(event.stream_id)
        await self.flush()

    async def read_until(self, done: Callable[[], bool]) -> None:
        """Receive until `done()` is true."""
        while not done():
            await self._receive()

    async def read_until_data(self, sid: int) -> bytes:
        """Receive until stream `sid` has some response body."""
        await self.read_until(lambda: bool(self.data[sid]))
        return bytes(self.data[sid])

    async def read_until_ended(self, sid: int) -> bytes:
        """Receive until stream `sid` has ended; its whole response body."""
        await self.read_until(lambda: sid in self.ended)
        return bytes(self.data[sid])

    async def reset(self, sid: int) -> None:
        self.conn.reset_stream(sid)
        await self.flush()
