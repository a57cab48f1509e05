"""A Responses API request becomes the chat job its equivalent chat body would, built as a
`ChatCompletionRequest` (no JSON written and read back in between)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from neuron_trio.errors import RequestError
from neuron_trio.http.openai import requests as chat_requests
from neuron_trio.http.openai.requests import parse_chat_request
from neuron_trio.http.openai.responses_api import history_of, parse_responses_request

TOOL = {"type": "object", "properties": {"city": {"type": "string"}}}

RESPONSES = {
    "model": "m",
    "instructions": "be brief",
    "input": [
        {"type": "message", "role": "developer", "content": "use tools"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"a":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ],
    "tools": [{"type": "function", "name": "weather", "parameters": TOOL, "strict": True}],
    "tool_choice": {"type": "function", "name": "weather"},
    "max_output_tokens": 40,
    "temperature": 0.5,
    "top_p": 0.9,
    "reasoning": {"effort": "low"},
}

CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": "use tools"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{}"},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"a":1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ],
    "tools": [
        {"type": "function", "function": {"name": "weather", "parameters": TOOL, "strict": True}}
    ],
    "tool_choice": {"type": "function", "function": {"name": "weather"}},
    "max_completion_tokens": 40,
    "temperature": 0.5,
    "top_p": 0.9,
    "reasoning_effort": "low",
}


def _encode(doc: dict[str, Any]) -> bytes:
    return msgspec.json.encode(doc)


@pytest.fixture
def no_chat_body_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chat's body decoding refused: a Responses request must not pass through it."""

    def refuse(*args: object, **kw: object) -> None:
        raise AssertionError("a Responses request was decoded as a chat body")

    monkeypatch.setattr(chat_requests, "decode_struct", refuse)


def test_a_responses_request_is_the_job_of_its_chat_equivalent() -> None:
    expected = parse_chat_request(_encode(CHAT)).job
    assert parse_responses_request(_encode(RESPONSES)).chat.job == expected


def test_the_chat_request_is_built_without_a_json_round_trip(no_chat_body_decode: None) -> None:
    json_format = {"format": {"type": "json_schema", "name": "w", "schema": TOOL}}
    doc = {"model": "m", "input": "hello", "text": json_format}
    job = parse_responses_request(_encode(doc)).chat.job
    assert job.messages is not None and job.messages[0].content == "hello"
    assert job.params.constraint is not None and job.params.constraint.kind == "json"


def test_chat_rules_still_name_the_field(no_chat_body_decode: None) -> None:
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}
    with pytest.raises(RequestError) as bad:
        parse_responses_request(_encode({"model": "m", "input": [call]}))
    assert bad.value.param == "messages[0].tool_calls"


def test_a_stored_answer_continues_the_conversation(no_chat_body_decode: None) -> None:
    first = parse_responses_request(_encode({"model": "m", "input": "hi"}))
    answer = [{"type": "message", "content": [{"type": "output_text", "text": "hello"}]}]
    history = (*first.history, *history_of(answer))
    later = parse_responses_request(
        _encode({"model": "m", "input": "again", "previous_response_id": "r"}), history
    )
    assert later.chat.job.messages is not None
    assert [(m.role, m.content) for m in later.chat.job.messages] == [
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "again"),
    ]
