"""HTTP/2 writes (hypercorn fix 6): the DATA frames that several streams have ready at once
leave in one socket write, not one write each; every byte still arrives, in order."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from hypercorn.events import RawData
from hypercorn.trio.tcp_server import TCPServer

from tests.http.fake_node import FakeNode
from tests.http.http_harness import RawH2, chat_body, run, serving, sse_events

STREAMS = 8
TOKENS = ("a", "b", "c", "d")


def test_tokens_of_many_streams_leave_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[int] = []  # sizes of the server's socket writes
    original = TCPServer.protocol_send

    async def counted(self: Any, event: Any) -> None:
        if isinstance(event, RawData):
            writes.append(len(event.data))
        await original(self, event)

    monkeypatch.setattr(TCPServer, "protocol_send", counted)
    node = FakeNode(tokens=TOKENS)
    released = [trio.Event() for _ in TOKENS]  # token i is produced once released[i] is set

    async def gate(i: int) -> None:
        await released[i].wait()

    node.gate = gate

    async def body() -> None:
        async with serving(node) as srv, RawH2.connect(srv.bound[0]) as client:
            doc = chat_body(stream=True, max_tokens=len(TOKENS))
            sids = [await client.post("/v1/chat/completions", doc) for _ in range(STREAMS)]
            while node.open < STREAMS:  # all wait for token 0 (and send nothing before it)
                node.entered = trio.Event()
                await node.entered.wait()
            # Token 0 also starts each response (a stream's headers wait for its first event,
            # http/generation.py): one HEADERS frame per stream. From token 1 on, DATA only.
            released[0].set()
            first = f'"content":"{TOKENS[0]}"'.encode()
            await client.read_until(lambda: all(first in client.data[s] for s in sids))
            for i, token in list(enumerate(TOKENS[:-1]))[1:]:  # the last one ends the streams
                mark = f'"content":"{token}"'.encode()
                writes.clear()
                released[i].set()  # all streams get token i in the same moment, as in a step
                await client.read_until(lambda mark=mark: all(mark in client.data[s] for s in sids))
                # One write (two if the send task woke between two streams' pushes), not 8.
                assert 1 <= len(writes) <= 2, (token, writes)
            released[-1].set()
            await client.read_until(lambda: all(s in client.ended for s in sids))
            for sid in sids:  # whole and in order on every stream
                events = sse_events(client.data[sid].decode())
                assert events[-1] == "[DONE]"
                text = "".join(
                    choice["delta"].get("content") or ""
                    for event in events[:-1]
                    for choice in event["choices"]
                )
                assert text == "".join(TOKENS)

    run(body)
