"""llama.cpp's server tests of tool calls (tools/server/tests/unit/test_tool_call.py),
ported to a real neuron on the built-in model (SmolLM2-135M: a ChatML template without
tools, so neuron renders the tools Hermes-style and parses `<tool_call>` blocks).

Ported: a required call (TEST_TOOL, PYTHON_TOOL; plain and streamed) is exactly one call to
the tool with its argument; no call without tools or with `tool_choice: "none"`; a
conversation holding a call and its result; and, from issue 26, `tool_choice: "auto"`: the
model may answer in text or call, but tool-call markup never reaches `content`, even when
`max_tokens` cuts the call.

Not ported, and why:
- the real-model matrix (Llama 3.x, Qwen 2.5, Hermes, Phi-3.5, Mistral Nemo, functionary,
  DeepSeek R1 …: `hello world` through the python tool, the weather in Istanbul, a
  calculation's result): 1–8 GB downloads each; neuron's per-family tool formats are tested
  with the tiny families' templates in tests/engine;
- `chat_template_file` overrides: a llama.cpp option (neuron uses the GGUF's template);
- `code_interpreter` tools: not an OpenAI chat tool type (a 400 naming it).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conformance.conftest import MODEL

TEST_TOOL = {
    "type": "function",
    "function": {
        "name": "test",
        "description": "",
        "parameters": {
            "type": "object",
            "properties": {"success": {"type": "boolean", "const": True}},
            "required": ["success"],
        },
    },
}
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Runs code in an ipython interpreter and returns the result.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The code to run.", "maxLength": 60}
            },
            "required": ["code"],
        },
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "The city and country, e.g. 'Paris, France'",
                    "maxLength": 40,
                }
            },
            "required": ["location"],
        },
    },
}
CODING = [
    {"role": "system", "content": "You are a coding assistant."},
    {"role": "user", "content": "Write an example"},
]
MARKUP = ("<tool_call", "</tool_call", "[TOOL_CALLS]", '{"name"')


@pytest.fixture(scope="module")
def client(api_base: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="dummy", base_url=api_base, max_retries=0, timeout=120)


def _collect(
    client: openai.OpenAI, stream: bool, **kw: Any
) -> tuple[str | None, list[dict[str, str]], str | None]:
    """(content, calls as {id, name, arguments}, finish_reason), streamed or not."""
    if not stream:
        res = client.chat.completions.create(model=MODEL, **kw)
        message = res.choices[0].message
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
            for c in message.tool_calls or ()
        ]
        return message.content, calls, res.choices[0].finish_reason
    content = ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool,argument_key", [(TEST_TOOL, "success"), (PYTHON_TOOL, "code")])
def test_completion_with_required_tool(
    client: openai.OpenAI, tool: dict[str, Any], argument_key: str, stream: bool
) -> None:
    content, calls, finish = _collect(
        client,
        stream,
        messages=CODING,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=128,
        temperature=0.0,
    )
    assert len(calls) == 1, (content, calls)
    assert content in (None, "")
    assert calls[0]["name"] == tool["function"]["name"]
    assert calls[0]["id"]
    assert argument_key in json.loads(calls[0]["arguments"])
    assert finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tools,tool_choice", [([], None), ([TEST_TOOL], "none"), ([PYTHON_TOOL], "none")]
)
def test_completion_without_tool_call(
    client: openai.OpenAI, tools: list[dict[str, Any]], tool_choice: str | None, stream: bool
) -> None:
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    if tool_choice is not None:
        kw["tool_choice"] = tool_choice
    _content, calls, finish = _collect(
        client,
        stream,
        messages=[
            {"role": "system", "content": "You are a coding assistant."},
            {"role": "user", "content": "say hello world with python"},
        ],
        max_tokens=16,
        **kw,
    )
    assert calls == []
    assert finish in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [3, 48])
def test_auto_tool_choice_never_leaks_markup(
    client: openai.OpenAI, stream: bool, max_tokens: int
) -> None:
    """Issue 26 item 1: with `auto` (the default when tools are given) whatever the model
    writes in its tool-call syntax is a call, never content; a call cut by `max_tokens`
    ends with `length` and no markup."""
    content, calls, finish = _collect(
        client,
        stream,
        messages=[{"role": "user", "content": "What is the weather in Istanbul?"}],
        tools=[WEATHER_TOOL],
        max_tokens=max_tokens,
        temperature=0.0,
    )
    assert not any(mark in (content or "") for mark in MARKUP), content
    assert not (content or "").lstrip().startswith("<"), content
    if calls:
        assert finish == "tool_calls"
        assert all(c["name"] == "get_current_weather" for c in calls)
        assert all("location" in json.loads(c["arguments"]) for c in calls)
    else:
        assert finish in ("stop", "length")


def test_calc_result_conversation(client: openai.OpenAI) -> None:
    """A conversation holding a call and its result is rendered and answered."""
    res = client.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        temperature=0.0,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="none",
        messages=[
            {"role": "user", "content": "What is the weather in Istanbul?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_6789",
                        "type": "function",
                        "function": {
                            "name": "get_current_weather",
                            "arguments": '{"location": "Istanbul, Turkey"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_6789", "content": "14 degrees, sunny"},
        ],
    )
    assert res.choices[0].message.tool_calls is None
    assert isinstance(res.choices[0].message.content, str)
