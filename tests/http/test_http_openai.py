"""The OpenAI wire format: jobs built from requests, response and SSE shapes, bad input."""

from __future__ import annotations

from typing import Any

import pytest

from neuron_trio.http.openai import parse_chat_request
from neuron_trio.http.openai.completion_batch import parse_completion_batch
from neuron_trio.service.api import ChatMessage
from tests.http.error_body import assert_error
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h2_client, run, serving, sse_events


def test_chat_request_becomes_a_job() -> None:
    body = chat_body(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "ok"},
        ],
        temperature=0,
        top_p=0.5,
        top_k=40,
        min_p=0.1,
        presence_penalty=-1,
        frequency_penalty=2,
        repetition_penalty=1.1,
        seed=-3,
        stop="END",
        max_completion_tokens=9,
        max_tokens=99,
        logprobs=True,
        top_logprobs=3,
        user="someone",
        n=1,
    )
    import msgspec

    parsed = parse_chat_request(msgspec.json.encode(body))
    job = parsed.job
    assert job.model == "fake-model" and job.prompt is None
    assert job.messages == (
        ChatMessage("system", "be brief"),
        ChatMessage("user", "a\nb"),
        ChatMessage("assistant", "ok"),
    )
    p = job.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 0.5, 40, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-1.0, 2.0, 1.1)
    assert (p.seed, p.stop, p.max_tokens) == (-3, ("END",), 9)
    assert (p.logprobs, p.top_logprobs) == (True, 3)
    assert not parsed.stream and not parsed.include_usage


def test_fields_clients_send_are_accepted_and_honoured_or_ignored() -> None:
    """What the openai client, LangChain and routers send by default is never a 400."""
    body = chat_body(
        messages=[
            {"role": "user", "content": "hi", "name": "ann"},
            {"role": "assistant", "content": "hello", "name": "bot"},
        ],
        store=False,
        metadata={"team": "search", "k2": "v"},
        service_tier="auto",
        user="end-user-1",
        safety_identifier="hash-of-user",
        prompt_cache_key="conversation-42",
        reasoning_effort="low",
        verbosity="medium",
        modalities=["text"],
        functions=None,
        function_call=None,
        logit_bias={"42": -100, "7": 2.5},
        stream=True,
        stream_options={"include_usage": True},
    )
    import msgspec

    parsed = parse_chat_request(msgspec.json.encode(body))
    assert parsed.stream and parsed.include_usage
    assert parsed.job.params.logit_bias == ((7, 2.5), (42, -100.0))
    assert [m.name for m in parsed.job.messages or ()] == ["ann", "bot"]
    completion = parse_completion_batch(
        b'{"model": "m", "prompt": "x", "logit_bias": {"3": 1}, "user": "u", "store": true}'
    ).first
    assert completion.job.params.logit_bias == ((3, 1.0),)


def test_chat_without_max_tokens_leaves_it_to_the_model() -> None:
    chat = parse_chat_request(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
    assert chat.job.params.max_tokens is None  # not 256: to the end of the context


def test_defaults_are_openai_defaults() -> None:
    chat = parse_chat_request(
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    ).job.params
    assert (chat.temperature, chat.top_p, chat.top_k, chat.presence_penalty) == (1.0, 1.0, 0, 0.0)
    assert chat.stop == () and chat.seed is None and not chat.logprobs
    completion = parse_completion_batch(b'{"model": "m", "prompt": ["x"], "top_k": -1}').first
    assert completion.job.prompt == "x"
    assert completion.job.params.max_tokens == 16
    assert completion.job.params.top_k == 0
    streamed = parse_completion_batch(
        b'{"model": "m", "prompt": "x", "stream": true, "stream_options": {"include_usage": true}, "logprobs": 2}'
    ).first
    assert streamed.stream and streamed.include_usage
    assert streamed.job.params.logprobs and streamed.job.params.top_logprobs == 2


def test_a_prompt_of_token_ids_is_used_as_given() -> None:
    parsed = parse_completion_batch(b'{"model": "m", "prompt": [1, 2, 3], "logprobs": 1}').first
    assert parsed.job.prompt_ids == (1, 2, 3) and parsed.job.prompt is None
    assert parsed.prompt_chars == 0  # text offsets count from the completion's start
    text = parse_completion_batch(b'{"model": "m", "prompt": "hey"}').first
    assert text.job.prompt == "hey" and text.job.prompt_ids is None and text.prompt_chars == 3


def test_chat_and_completion_bodies() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post(
                "/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2)
            )
            doc = r.json()
            assert doc["object"] == "chat.completion" and doc["id"].startswith("chatcmpl-")
            assert doc["model"] == "fake-model" and isinstance(doc["created"], int)
            (choice,) = doc["choices"]
            assert choice["message"] == {"role": "assistant", "content": "Hello, world!"}
            assert choice["finish_reason"] == "stop"
            content = choice["logprobs"]["content"]
            assert [c["token"] for c in content] == ["Hello", ",", " world", "!"]
            assert content[0]["bytes"] == list(b"Hello")
            assert [t["token"] for t in content[0]["top_logprobs"]] == ["alt0", "alt1"]
            assert doc["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}

            r = await client.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "hey", "max_tokens": 2}
            )
            doc = r.json()
            assert doc["object"] == "text_completion" and doc["id"].startswith("cmpl-")
            (choice,) = doc["choices"]
            assert (choice["text"], choice["finish_reason"], choice["logprobs"]) == (
                "Hello,",
                "length",
                None,
            )
            assert doc["usage"]["completion_tokens"] == 2

            r = await client.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "hey", "logprobs": 1}
            )
            lp = r.json()["choices"][0]["logprobs"]
            assert lp["tokens"] == ["Hello", ",", " world", "!"]
            assert lp["text_offset"] == [3, 8, 9, 15]
            assert lp["top_logprobs"][0] == {"alt0": -1.0}

    run(body)


def test_chat_stream_shape_with_usage() -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            r = await client.post(
                "/v1/chat/completions",
                json=chat_body(stream=True, stream_options={"include_usage": True}),
            )
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert len({c["id"] for c in chunks}) == 1
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(
                c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]
            )
            assert text == "Hello, world!"
            assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
            assert all(c["usage"] is None for c in chunks[:-1])
            assert chunks[-1]["choices"] == []
            assert chunks[-1]["usage"] == {
                "prompt_tokens": 7,
                "completion_tokens": 4,
                "total_tokens": 11,
            }

    run(body)


def test_completion_stream_shape_without_usage() -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            r = await client.post(
                "/v1/completions",
                json={"model": "fake-model", "prompt": "x", "stream": True, "max_tokens": 3},
            )
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
            assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    run(body)


def test_a_model_that_wedges_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def body() -> None:
        node = FakeNode()
        node.fail_at = 2
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body(stream=True))
            assert r.status_code == 200
            events = sse_events(r.text)
            assert "[DONE]" not in events
            assert events[-1]["error"]["type"] == "service_unavailable"
            assert events[-1]["error"]["code"] == "wedged"
            # without streaming, the same failure is a 503
            r = await client.post("/v1/chat/completions", json=chat_body())
            assert_error(r, 503)
            assert (await client.get("/health")).status_code == 200

    run(body)


@pytest.mark.parametrize("reason", ["error", "cancelled"])
def test_abnormal_finish_reasons(reason: str) -> None:
    async def body() -> None:
        node = FakeNode()
        node.finish_reason = reason
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
            assert_error(r, 500 if reason == "error" else 503)
            r = await client.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True}
            )
            events = sse_events(r.text)
            assert "error" in events[-1] and "[DONE]" not in events

    run(body)


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (path, body, status, param the error must name; None: no field to name)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


BAD_INPUT: list[tuple[str, Any, int, str | None]] = [
    (CHAT, {"messages": MSGS}, 400, "model"),
    (CHAT, {"model": "fake-model"}, 400, "messages"),
    (CHAT, {"model": "nope", "messages": MSGS}, 404, "model"),
    (CHAT, {"model": "", "messages": MSGS}, 400, "model"),
    (CHAT, {"model": 3, "messages": MSGS}, 400, "model"),
    (CHAT, {"model": "fake-model", "messages": []}, 400, "messages"),
    (CHAT, {"model": "fake-model", "messages": "hi"}, 400, "messages"),
    (
        CHAT,
        {"model": "fake-model", "messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0].tool_call_id",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": [{"role": "assistant", "content": None}]},
        400,
        "messages[0].content",
    ),
    (
        CHAT,
        {
            "model": "fake-model",
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "[1]"},
                        }
                    ],
                }
            ],
        },
        400,
        "messages[0].tool_calls",
    ),
    (CHAT, {"model": "fake-model", "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (
        CHAT,
        {"model": "fake-model", "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
    ),
    (
        CHAT,
        {
            "model": "fake-model",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
        400,
        "messages[0].content[0].type",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": [{"role": "user", "content": "x", "name": "b" * 257}]},
        400,
        "messages[0].name",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "temperature": 2.5}, 400, "temperature"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "temperature": -0.1}, 400, "temperature"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "top_p": 0}, 400, "top_p"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "top_k": -2}, 400, "top_k"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "top_k": 1.5}, 400, "top_k"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "min_p": 1.5}, 400, "min_p"),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "frequency_penalty": -2.5},
        400,
        "frequency_penalty",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "seed": "x"}, 400, "seed"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "seed": 2**64}, 400, "seed"),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "stop": ["a", "b", "c", "d", "e"]},
        400,
        "stop",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "stop": [1]}, 400, "stop[0]"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "stop": ""}, 400, "stop"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "max_tokens": 0}, 400, "max_tokens"),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "max_completion_tokens": -1},
        400,
        "max_completion_tokens",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "n": 9}, 400, "n"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "logprobs": 1}, 400, "logprobs"),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "stream": "yes"}, 400, "stream"),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "stream_options": {"x": 1}},
        400,
        "stream_options.x",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "tools": [{"type": "function", "function": {}}]},
        400,
        "tools[0].function.name",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "tools": [TOOL], "tool_choice": named("nope")},
        400,
        "tool_choice",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "tools": [TOOL, TOOL]}, 400, "tools"),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "tools": [TOOL], "tool_choice": "sometimes"},
        400,
        "tool_choice",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "response_format": {"type": "yaml"}},
        400,
        "response_format.type",
    ),
    (
        CHAT,
        {
            "model": "fake-model",
            "messages": MSGS,
            "response_format": {"type": "json_object"},
            "tools": [TOOL],
        },
        400,
        "response_format",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "logit_bias": {"5": 100.5}},
        400,
        "logit_bias[...]",
    ),
    (
        COMP,
        {"model": "fake-model", "prompt": "x", "logit_bias": {"5": -101}},
        400,
        "logit_bias[...]",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (
        COMP,
        {"model": "fake-model", "prompt": "x", "stream": False, "stream_options": {}},
        400,
        "stream_options",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "modalities": ["audio"]},
        400,
        "modalities[0]",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "functions": []}, 400, "functions"),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "function_call": "auto"},
        400,
        "function_call",
    ),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "metadata": {str(i): "v" for i in range(17)}},
        400,
        "metadata",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "metadata": {"k": 1}}, 400, "metadata[...]"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "service_tier": "gold"}, 400, "service_tier"),
    (
        CHAT,
        {"model": "fake-model", "messages": MSGS, "reasoning_effort": "extreme"},
        400,
        "reasoning_effort",
    ),
    (CHAT, {"model": "fake-model", "messages": MSGS, "verbosity": 3}, 400, "verbosity"),
    (CHAT, {"model": "fake-model", "messages": MSGS, "user": "u" * 1025}, 400, "user"),
    (CHAT, [1, 2], 400, None),
    (CHAT, "just a string", 400, None),
    (COMP, {"prompt": "x"}, 400, "model"),
    (COMP, {"model": "fake-model"}, 400, "prompt"),
    (COMP, {"model": "fake-model", "prompt": ["a", 1]}, 400, "prompt[1]"),
    (COMP, {"model": "fake-model", "prompt": [[1, 2], []]}, 400, "prompt[1]"),
    (COMP, {"model": "fake-model", "prompt": [1, 2, "x", 3]}, 400, "prompt[2]"),
    (COMP, {"model": "fake-model", "prompt": [[1, -2]]}, 400, "prompt[0][1]"),
    (COMP, {"model": "fake-model", "prompt": [1.5]}, 400, "prompt[0]"),
    (COMP, {"model": "fake-model", "prompt": []}, 400, "prompt"),
    (COMP, {"model": "fake-model", "prompt": ["a"] * 17}, 400, "prompt"),
    (COMP, {"model": "fake-model", "prompt": ["a"] * 3, "n": 6}, 400, "prompt"),
    (COMP, {"model": "fake-model", "prompt": "x", "suffix": "tail"}, 400, "suffix"),
    (COMP, {"model": "fake-model", "prompt": "x", "best_of": 3}, 400, "best_of"),
    (COMP, {"model": "fake-model", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (COMP, {"model": "fake-model", "prompt": "x", "logprobs": True}, 400, "logprobs"),
    (COMP, {"model": "fake-model", "prompt": "x", "n": 0}, 400, "n"),
    (COMP, {"model": "fake-model", "prompt": "x", "messages": MSGS}, 400, "messages"),
    (COMP, {"model": "nope", "prompt": "x", "stream": True}, 404, "model"),
]


def test_bad_input_table() -> None:
    """Every malformed request is a 4xx JSON error naming its field, and the node stays healthy."""

    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            for path, doc, status, param in BAD_INPUT:
                r = await client.post(path, json=doc)
                err = assert_error(r, status)
                assert err["param"] == param, (doc, err)
                if param is not None:
                    assert param.split("[")[0].split(".")[0] in err["message"], err
            assert not node.jobs
            assert (await client.get("/health")).status_code == 200

    run(body)


def test_unsupported_fields_are_all_named() -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            r = await client.post(
                "/v1/chat/completions", json=chat_body(prediction={}, audio={}, functions=None)
            )
            err = assert_error(r, 400)
            assert err["message"] == "unsupported field(s): audio, prediction"

    run(body)
