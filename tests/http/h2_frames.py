"""A raw HTTP/2 client for the hardening and abuse tests: `Frames` speaks `h2` over a trio socket
and records every event (status, data, end, reset, GOAWAY) by stream, so a test can send what no
well-behaved client would."""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import trio


class Frames:
    """An `h2` client connection over a trio socket that records every event by stream."""

    def __init__(self, stream: trio.SocketStream, authority: str) -> None:
        self.stream = stream
        self.authority = authority
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.data: dict[int, bytearray] = {}
        self.status: dict[int, int] = {}
        self.ended: set[int] = set()
        self.reset: dict[int, int] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = False

    @classmethod
    async def open(cls, url: str) -> Frames:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        client = cls(stream, f"{host}:{port}")
        client.conn.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.closed:
            try:
                await self.stream.send_all(data)
            except trio.BrokenResourceError:
                self.closed = True  # the server closed it

    def request(
        self, method: str, path: str, *, body: bytes | None = None, end: bool = True
    ) -> int:
        sid: int = self.conn.get_next_available_stream_id()
        headers = [(":method", method), (":path", path), (":scheme", "http")]
        headers += [(":authority", self.authority), ("content-type", "application/json")]
        self.conn.send_headers(sid, headers, end_stream=end and body is None)
        if body is not None:
            self.conn.send_data(sid, body, end_stream=end)
        self.data[sid] = bytearray()
        return sid

    async def receive(self) -> None:
        try:
            raw = await self.stream.receive_some(1 << 16)
        except trio.BrokenResourceError:
            raw = b""
        if not raw:
            self.closed = True
            return
        for event in self.conn.receive_data(raw):
            if isinstance(event, h2.events.ResponseReceived):
                self.status[event.stream_id] = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.DataReceived):
                self.data.setdefault(event.stream_id, bytearray()).extend(event.data)
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self.reset.setdefault(event.stream_id, event.error_code)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaway = event
        await self.flush()

    async def until(self, done: Any) -> None:
        while not done() and not self.closed:
            await self.receive()

    async def aclose(self) -> None:
        await self.stream.aclose()
