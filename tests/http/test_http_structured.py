"""response_format, tools and n over HTTP: what reaches the node, and what the client sees."""

from __future__ import annotations

import json
from typing import Any

from neuron_trio.http.openai import parse_chat_request
from neuron_trio.service.api import SequenceEvent, ToolCall
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h2_client, run, serving, sse_events

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Now"}},
]


def _parse(**extra: Any) -> Any:
    return parse_chat_request(json.dumps(chat_body(**extra)).encode()).job


def test_response_formats_become_json_constraints() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    job = _parse(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert job.params.constraint.kind == "json"
    assert json.loads(job.params.constraint.schema) == schema
    assert job.params.tools == ()
    job = _parse(response_format={"type": "json_object"})
    assert json.loads(job.params.constraint.schema) == {"type": "object"}
    assert _parse(response_format={"type": "text"}).params.constraint is None


def test_tool_choice_modes() -> None:
    auto = _parse(tools=TOOLS)
    assert auto.params.constraint is None
    assert [t.name for t in auto.params.tools] == ["get_weather", "get_time"]
    assert json.loads(auto.params.tools[1].parameters) == {"type": "object", "properties": {}}
    none = _parse(tools=TOOLS, tool_choice="none")
    assert none.params.constraint is None and none.params.tools == ()
    required = _parse(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.params.constraint.kind == "tool_call"
    assert len(required.params.constraint.tools) == 2 and not required.params.constraint.parallel
    named = _parse(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [t.name for t in named.params.constraint.tools] == ["get_time"]
    assert named.params.constraint.parallel is False


def test_tool_messages_are_accepted_in_the_conversation() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
    ]
    job = parse_chat_request(json.dumps(chat_body(messages=messages, tools=TOOLS)).encode()).job
    assistant, tool = job.messages[1], job.messages[2]
    assert assistant.tool_calls == (ToolCall("c1", "get_weather", '{"city":"Oslo"}'),)
    assert tool.role == "tool" and tool.tool_call_id == "c1" and tool.content == "-3 C"


CALL = ToolCall("call_abc", "get_weather", '{"city": "Paris"}')


def _tool_script() -> list[SequenceEvent]:
    return [
        SequenceEvent(seq_id=0, text="", token_ids=[1], prompt_tokens=9, completion_tokens=1),
        SequenceEvent(
            seq_id=0,
            token_ids=[2],
            tool_calls=[CALL],
            finish_reason="tool_calls",
            prompt_tokens=9,
            completion_tokens=12,
        ),
    ]


def test_a_tool_call_answer_plain_and_streamed() -> None:
    async def body() -> None:
        node = FakeNode()
        node.script = _tool_script()
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body(tools=TOOLS))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["content"] is None
            assert choice["message"]["tool_calls"] == [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ]
            r = await client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, stream=True))
            chunks = [c for c in sse_events(r.text) if c != "[DONE]"]
            deltas = [c["choices"][0]["delta"] for c in chunks]
            calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
            assert calls[0] == {
                "index": 0,
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
            assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
            assert all("id" not in c for c in calls[1:])
            assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    run(body)


def _n_script() -> list[SequenceEvent]:
    def ev(
        index: int, text: str, n: int, finish: str | None = None, more: bool = False
    ) -> SequenceEvent:
        return SequenceEvent(
            seq_id=0,
            index=index,
            text=text,
            token_ids=[index],
            finish_reason=finish,
            prompt_tokens=5,
            completion_tokens=n,
            more_choices=more,
        )

    return [
        ev(0, "a", 1),
        ev(1, "x", 1),
        ev(1, "y", 2, "stop", more=True),
        ev(0, "b", 2),
        ev(0, "c", 3, "length"),
    ]


def test_n_choices_with_indexes_and_usage_over_all() -> None:
    async def body() -> None:
        node = FakeNode()
        node.script = _n_script()
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body(n=2))
            doc = r.json()
            assert [
                (c["index"], c["message"]["content"], c["finish_reason"]) for c in doc["choices"]
            ] == [
                (0, "abc", "length"),
                (1, "xy", "stop"),
            ]
            assert doc["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
            assert node.jobs[-1].params.n == 2
            r = await client.post(
                "/v1/chat/completions",
                json=chat_body(n=2, stream=True, stream_options={"include_usage": True}),
            )
            chunks = [c for c in sse_events(r.text) if c != "[DONE]"]
            texts: dict[int, str] = {}
            finishes: dict[int, str] = {}
            for c in chunks[:-1]:
                for choice in c["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"].get(
                        "content", ""
                    )
                    if choice["finish_reason"]:
                        finishes[choice["index"]] = choice["finish_reason"]
            assert texts == {0: "abc", 1: "xy"} and finishes == {0: "length", 1: "stop"}
            roles = [
                c["choices"][0]["index"]
                for c in chunks
                if c["choices"] and "role" in c["choices"][0]["delta"]
            ]
            assert roles == [0, 1]
            assert chunks[-1]["usage"]["completion_tokens"] == 5

    run(body)


def test_completions_take_n_too() -> None:
    async def body() -> None:
        node = FakeNode()
        node.script = _n_script()
        async with serving(node) as srv, h2_client(srv.url) as client:
            doc = {"model": "fake-model", "prompt": "p", "n": 2, "max_tokens": 3}
            r = await client.post("/v1/completions", json=doc)
            choices = r.json()["choices"]
            assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
                (0, "abc", "length"),
                (1, "xy", "stop"),
            ]
            r = await client.post("/v1/completions", json={**doc, "stream": True})
            texts: dict[int, str] = {}
            for chunk in sse_events(r.text)[:-1]:
                for c in chunk["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            assert texts == {0: "abc", 1: "xy"}

    run(body)
