"""The Responses API (`/v1/responses`) through the official `openai` client, against the fake
node: text in and out, the streamed events, function calls, `previous_response_id`, bad
input, and the store's bounds."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from neuron_trio.http.response_store import ResponseNotFoundError, ResponseStore
from neuron_trio.service.api import SequenceEvent, ToolCall
from tests.http.error_body import assert_error
from tests.http.fake_node import FakeNode
from tests.http.http_harness import h2_client, run, serving


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(http2=True, timeout=10),  # type: ignore[arg-type]
    )


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL_SCRIPT = [
    SequenceEvent(seq_id=0, text="\n", prompt_tokens=9, completion_tokens=1),
    SequenceEvent(
        seq_id=0,
        tool_calls=[ToolCall("call_1", "get_weather", '{"city":"Paris"}')],
        finish_reason="tool_calls",
        prompt_tokens=9,
        completion_tokens=12,
    ),
]


def test_text_in_and_out() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, _client(srv.url) as client:
            r = await client.responses.create(
                model="fake-model",
                instructions="be brief",
                input="hi",
                temperature=0,
                metadata={"k": "v"},
            )
            assert r.object == "response" and r.status == "completed"
            assert r.output_text == "Hello, world!"
            assert r.usage is not None
            assert (r.usage.input_tokens, r.usage.output_tokens) == (7, 4)
            assert r.metadata == {"k": "v"} and r.instructions == "be brief"
            (job,) = node.jobs
            assert job.messages is not None
            assert [(m.role, m.content) for m in job.messages] == [
                ("system", "be brief"),
                ("user", "hi"),
            ]
            assert job.params.temperature == 0.0
            again = await client.responses.retrieve(r.id)
            assert again.output_text == "Hello, world!"

    run(body)


def test_input_items_and_max_output_tokens() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, _client(srv.url) as client:
            r = await client.responses.create(
                model="fake-model",
                input=[
                    {"role": "developer", "content": "d"},
                    {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                    {
                        "type": "function_call",
                        "call_id": "c1",
                        "name": "f",
                        "arguments": "{}",
                    },
                    {"type": "function_call_output", "call_id": "c1", "output": "42"},
                ],
                max_output_tokens=2,
            )
            assert r.status == "incomplete"
            assert r.incomplete_details is not None
            assert r.incomplete_details.reason == "max_output_tokens"
            assert r.output_text == "Hello,"
            messages = node.jobs[0].messages
            assert messages is not None
            assert [m.role for m in messages] == ["system", "user", "assistant", "tool"]
            assert messages[2].tool_calls[0].name == "f"
            assert messages[3].tool_call_id == "c1" and messages[3].content == "42"
            assert node.jobs[0].params.max_tokens == 2

    run(body)


def test_streamed_events_in_openai_order() -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv, _client(srv.url) as client:
            stream = await client.responses.create(model="fake-model", input="hi", stream=True)
            events = [e async for e in stream]
            kinds = [e.type for e in events]
            assert kinds == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                *["response.output_text.delta"] * 4,
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert deltas == "Hello, world!"
            final = events[-1].response  # type: ignore[union-attr]
            assert final.output_text == "Hello, world!" and final.usage.output_tokens == 4

    run(body)


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_become_function_call_items(stream: bool) -> None:
    async def body() -> None:
        node = FakeNode()
        node.script = CALL_SCRIPT
        async with serving(node) as srv, _client(srv.url) as client:
            kw: dict[str, Any] = {"model": "fake-model", "input": "weather?", "tools": [WEATHER]}
            if stream:
                events = [e async for e in await client.responses.create(stream=True, **kw)]
                kinds = [e.type for e in events]
                assert "response.output_text.delta" not in kinds  # whitespace opens nothing
                assert "response.function_call_arguments.done" in kinds
                r = events[-1].response  # type: ignore[union-attr]
            else:
                r = await client.responses.create(**kw)
            (item,) = r.output
            assert item.type == "function_call"
            assert (item.call_id, item.name) == ("call_1", "get_weather")
            assert item.arguments == '{"city":"Paris"}'
            (job,) = node.jobs
            assert [t.name for t in job.params.tools] == ["get_weather"]

    run(body)


def test_previous_response_id_continues_the_conversation() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, _client(srv.url) as client:
            first = await client.responses.create(model="fake-model", input="one")
            await client.responses.create(
                model="fake-model", input="two", previous_response_id=first.id
            )
            messages = node.jobs[1].messages
            assert messages is not None
            assert [(m.role, m.content) for m in messages] == [
                ("user", "one"),
                ("assistant", "Hello, world!"),
                ("user", "two"),
            ]
            unstored = await client.responses.create(model="fake-model", input="x", store=False)
            with pytest.raises(openai.NotFoundError) as e:
                await client.responses.create(
                    model="fake-model", input="y", previous_response_id=unstored.id
                )
            assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]

    run(body)


BAD = [
    ({"model": "fake-model", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    (
        {
            "model": "fake-model",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
        },
        "input[0].content[0]",
    ),
    ({"model": "fake-model", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"model": "fake-model", "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "fake-model", "input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"model": "fake-model", "input": "x", "frobnicate": 1}, "frobnicate"),
    ({"model": "fake-model", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "fake-model", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    (
        {"model": "fake-model", "input": "x", "text": {"format": {"type": "json_schema"}}},
        "text.format.name",
    ),
    (
        {
            "model": "fake-model",
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "answer"}},
        },
        "text.format.schema",
    ),
]


def test_bad_input_is_a_400_naming_the_field() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            for doc, param in BAD:
                err = assert_error(await client.post("/v1/responses", json=doc), 400)
                assert err["param"] == param, (doc, err)
            missing = {"model": "fake-model", "input": "x", "previous_response_id": "resp_x"}
            assert_error(await client.post("/v1/responses", json=missing), 404)
            assert_error(await client.get("/v1/responses/resp_x"), 404)
            assert_error(
                await client.post("/v1/responses", json={"model": "nope", "input": "x"}), 404
            )
            assert not node.jobs

    run(body)


def test_a_wedge_mid_stream_is_an_error_event() -> None:
    async def body() -> None:
        node = FakeNode()
        node.fail_at = 2
        async with serving(node) as srv, _client(srv.url) as client:
            stream = await client.responses.create(model="fake-model", input="hi", stream=True)
            events = [e async for e in stream]
            # OpenAI's shape: an `error` event (ResponseErrorEvent), then the stream ends
            assert events[-1].type == "error"
            assert events[-1].code == "wedged"  # type: ignore[union-attr]
            assert "response.completed" not in [e.type for e in events]
            await node.exited.wait()  # the sequence is not left running
            assert node.open == 0

    run(body)


def test_store_is_bounded_by_count_and_bytes() -> None:
    store = ResponseStore(max_responses=2, max_bytes=350)
    for i in range(3):
        store.put(f"r{i}", ({"role": "user", "content": "x"},), {"id": f"r{i}"})
    assert len(store) == 2
    with pytest.raises(ResponseNotFoundError):
        store.get("r0")
    store.put("big", ({"role": "user", "content": "y" * 300},), {"id": "big"})
    assert len(store) == 1 and store.get("big").history[0]["content"] == "y" * 300
    store.put("huge", ({"role": "user", "content": "z" * 500},), {})
    with pytest.raises(ResponseNotFoundError):
        store.get("huge")
