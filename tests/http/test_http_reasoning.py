"""A thinking model's answer over HTTP, against the fake node: the thinking in
`message.reasoning_content` / `delta.reasoning_content` (vLLM's and llama.cpp's field) and in
the Responses API's `reasoning` item and events, read by the official `openai` client; a tool
call after it; `chat_template_kwargs` and `reasoning_effort` given to the template, bounded."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from neuron_trio.service.api import SequenceEvent, ToolCall
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h2_client, run, serving

THINKING = "The user wants the weather. I should call get_weather."
SCRIPT = [
    SequenceEvent(seq_id=0, reasoning="The user wants the weather.", completion_tokens=6),
    SequenceEvent(seq_id=0, reasoning=" I should call get_weather.", completion_tokens=12),
    SequenceEvent(seq_id=0, text="Let me check.", completion_tokens=16),
    SequenceEvent(
        seq_id=0,
        tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Paris"}')],
        finish_reason="tool_calls",
        prompt_tokens=9,
        completion_tokens=30,
    ),
]
CHAT_TOOL: Any = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
RESPONSES_TOOL: Any = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(http2=True, timeout=10),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("stream", [False, True])
def test_chat_thinking_is_reasoning_content(stream: bool) -> None:
    async def body() -> None:
        node = FakeNode()
        node.script = SCRIPT
        async with serving(node) as srv, _client(srv.url) as client:
            kw: dict[str, Any] = {
                "model": "fake-model",
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [CHAT_TOOL],
            }
            if stream:
                reasoning, content, calls, finish = "", "", [], None
                async for chunk in await client.chat.completions.create(stream=True, **kw):
                    for choice in chunk.choices:
                        delta = choice.delta
                        reasoning += getattr(delta, "reasoning_content", None) or ""
                        content += delta.content or ""
                        calls += [c.function.name for c in delta.tool_calls or () if c.function]
                        finish = choice.finish_reason or finish
            else:
                r = await client.chat.completions.create(**kw)
                message = r.choices[0].message
                reasoning = getattr(message, "reasoning_content", "")
                content = message.content or ""
                calls = [c.function.name for c in message.tool_calls or ()]  # type: ignore[union-attr]
                finish = r.choices[0].finish_reason
            assert (reasoning, content, finish) == (THINKING, "Let me check.", "tool_calls")
            assert [c for c in calls if c] == ["get_weather"]

    run(body)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_thinking_is_a_reasoning_item(stream: bool) -> None:
    async def body() -> None:
        node = FakeNode()
        node.script = SCRIPT
        async with serving(node) as srv, _client(srv.url) as client:
            kw: dict[str, Any] = {
                "model": "fake-model",
                "input": "weather?",
                "tools": [RESPONSES_TOOL],
            }
            if stream:
                events = [e async for e in await client.responses.create(stream=True, **kw)]
                kinds = [e.type for e in events]
                deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
                assert "".join(deltas) == THINKING
                assert kinds.index("response.reasoning_text.done") < kinds.index(
                    "response.output_text.delta"
                )
                r = events[-1].response  # type: ignore[union-attr]
            else:
                r = await client.responses.create(**kw)
            assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
            thinking = r.output[0]
            assert thinking.type == "reasoning" and thinking.content is not None
            assert [c.text for c in thinking.content] == [THINKING]
            assert r.output_text == "Let me check."

    run(body)


def test_chat_template_kwargs_reach_the_template_bounded() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            kwargs = {"enable_thinking": False, "mode": "fast"}
            ok = chat_body(chat_template_kwargs=kwargs, reasoning_effort="low")
            assert (await client.post("/v1/chat/completions", json=ok)).status_code == 200
            assert node.jobs[0].template_kwargs == (
                ("enable_thinking", False),
                ("mode", "fast"),
                ("reasoning_effort", "low"),
            )
            bad = [
                {"enable_thinking": {"nested": True}},  # scalars only
                {f"k{i}": 1 for i in range(17)},  # at most 16
                {"messages": []},  # a name neuron sets
                {"not a name": 1},
                {"x": "y" * 257},
            ]
            for kwargs in bad:
                r = await client.post(
                    "/v1/chat/completions", json=chat_body(chat_template_kwargs=kwargs)
                )
                assert r.status_code == 400, (kwargs, r.text)
                error = r.json()["error"]
                assert "chat_template_kwargs" in (error["param"] or "") + error["message"], error
            assert len(node.jobs) == 1

    run(body)


def test_responses_reasoning_effort_reaches_the_template() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            ok = {"model": "fake-model", "input": "hi", "reasoning": {"effort": "low"}}
            r = await client.post("/v1/responses", json=ok)
            assert r.status_code == 200, r.text
            assert r.json()["reasoning"]["effort"] == "low"
            assert node.jobs[0].template_kwargs == (("reasoning_effort", "low"),)
            bad = {**ok, "reasoning": {"effort": "extreme"}}
            r = await client.post("/v1/responses", json=bad)
            assert r.status_code == 400 and "reasoning.effort" in r.text, r.text

    run(body)
