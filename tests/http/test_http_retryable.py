"""What a router may retry: a request the node could not start answers 503 with Retry-After
before any byte of a response, streams included (bench/router_drill.py, deploy/haproxy/).

A stream's headers wait for its first event: a model that wedges (or a node that drains)
before a stream's first token gives a plain 503, which HAProxy's `retry-on 503` sends to another
node; once a token has gone out, the failure is an error event, as before.
"""

from __future__ import annotations

from neuron_trio.service.api import SequenceEvent
from tests.http.error_body import assert_error
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h2_client, run, serving, sse_events


def test_a_stream_that_fails_before_its_first_event_is_a_retryable_503() -> None:
    async def body() -> None:
        node = FakeNode()
        node.fail_at = 0  # the model wedges before producing anything for this request
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body(stream=True))
            assert_error(r, 503)
            assert r.headers["retry-after"] == "5"
            assert r.json()["error"]["code"] == "wedged"
            r = await client.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True}
            )
            assert_error(r, 503)
            r = await client.post(
                "/v1/responses", json={"model": "fake-model", "input": "x", "stream": True}
            )
            assert_error(r, 503)

    run(body)


def test_a_stream_that_fails_after_its_first_event_ends_with_an_error_event() -> None:
    async def body() -> None:
        node = FakeNode()
        node.fail_at = 1
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body(stream=True))
            assert r.status_code == 200
            events = sse_events(r.text)
            assert events[-1]["error"]["code"] == "wedged"
            assert "[DONE]" not in events

    run(body)


def test_a_stream_cancelled_by_the_node_before_its_first_token_is_a_503() -> None:
    async def body() -> None:
        node = FakeNode()
        # e.g. the model failed every request when a step wedged: the sequence ends at once
        node.script = [SequenceEvent(seq_id=0, finish_reason="cancelled")]
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body(stream=True))
            assert_error(r, 503)

    run(body)
