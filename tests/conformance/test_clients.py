"""The clients people use, unchanged, against a real neuron on the built-in model: the
official `openai` (sync, async, streamed, `parse`, `pydantic_function_tool`,
`models.retrieve`, `responses.create`), LangChain's `ChatOpenAI` (`invoke`, `stream`,
`bind_tools` with and without `strict`, `with_structured_output`) and litellm.

What each asserts is what the client's user relies on: the parsed object, the tool calls
LangChain hands to an agent, no tool-call markup in any text.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
import trio
from pydantic import BaseModel, ConfigDict, Field

from tests.conformance.conftest import MODEL

MARKUP = ("<tool_call", "</tool_call", "[TOOL_CALLS]")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Location(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class GetWeather(BaseModel):
    """The current weather at a location."""

    model_config = ConfigDict(extra="forbid")
    location: Location  # nested: issue 26 saw this become a 400 with a compiler dump
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def client(api_base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_base, api_key="unused", max_retries=0, timeout=120)


# --- openai ---------------------------------------------------------------------------


def test_openai_sync(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    assert chat.choices[0].message.content
    assert chat.system_fingerprint and chat.usage is not None
    completion = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=4)
    assert completion.choices[0].text is not None


def test_openai_async(api_base: str) -> None:
    async def main() -> None:
        async with openai.AsyncOpenAI(
            base_url=api_base, api_key="unused", max_retries=0, timeout=120
        ) as aclient:
            chats = []

            async def one() -> None:
                chats.append(
                    await aclient.chat.completions.create(
                        model=MODEL,
                        messages=QUESTION,
                        max_tokens=8,  # type: ignore[arg-type]
                    )
                )

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(one)
            assert len(chats) == 3
            for chat in chats:  # sampled: an end of turn drawn first is an empty answer
                assert isinstance(chat.choices[0].message.content, str)
                assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 8

    trio.run(main)


def test_openai_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None
    assert all(c.system_fingerprint == chunks[0].system_fingerprint for c in chunks)


@pytest.mark.parametrize("beta", [False, True])
def test_openai_parse(client: openai.OpenAI, beta: bool) -> None:
    parse = client.beta.chat.completions.parse if beta else client.chat.completions.parse
    result = parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a city and its country."}],
        response_format=City,
        max_tokens=48,
        temperature=0,  # sampled, the built-in model may name a city "" (the schema allows it)
    )
    city = result.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country


def test_openai_pydantic_function_tool(client: openai.OpenAI) -> None:
    result = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris, France?"}],
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        max_tokens=64,
        # one call, greedy: at temperature 1 with parallel calls allowed, the small model may
        # go on to further calls until max_tokens (finish "length", which parse() refuses)
        parallel_tool_calls=False,
        temperature=0,
    )
    (call,) = result.choices[0].message.tool_calls or []
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_openai_models_retrieve(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_openai_responses_create(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL,
        instructions="Answer in one sentence.",
        input="What is the capital of France?",
        max_output_tokens=16,
        temperature=0,
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage is not None and first.usage.output_tokens > 0
    events = list(
        client.responses.create(
            model=MODEL,
            input="And of Italy?",
            previous_response_id=first.id,
            max_output_tokens=16,
            temperature=0,
            stream=True,
        )
    )
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text  # type: ignore[union-attr]


def test_openai_responses_function_call(client: openai.OpenAI) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
    result = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=48,
    )
    calls = [item for item in result.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"  # type: ignore[union-attr]
    assert "city" in json.loads(calls[0].arguments)  # type: ignore[union-attr]


# --- LangChain ------------------------------------------------------------------------


def _chat_openai(api_base: str, **kw: Any) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=api_base, api_key="unused", max_retries=0, timeout=120, **kw
    )


def test_langchain_invoke(api_base: str) -> None:
    llm = _chat_openai(api_base, max_tokens=12, temperature=0)
    answer = llm.invoke("What is the capital of France?")
    assert isinstance(answer.content, str) and answer.content
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] > 0


def test_langchain_stream(api_base: str) -> None:
    llm = _chat_openai(api_base, max_tokens=12, temperature=0)
    parts = list(llm.stream("What is the capital of France?"))
    assert len(parts) > 1
    assert (
        "".join(str(p.content) for p in parts)
        == llm.invoke("What is the capital of France?").content
    )


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


@pytest.mark.parametrize("strict", [None, True])
def test_langchain_bind_tools(api_base: str, strict: bool | None) -> None:
    """Issue 26: `bind_tools` without `strict` returned `tool_calls == []` and the raw
    `<tool_call>` markup as the answer. Whatever the model chooses, LangChain must get
    either parsed calls or clean text."""
    llm = _chat_openai(api_base, max_tokens=48, temperature=0)
    kw = {} if strict is None else {"strict": strict}
    bound = llm.bind_tools([get_weather], **kw)
    answer = bound.invoke("What is the weather in Paris? Use the tool.")
    assert not any(mark in str(answer.content) for mark in MARKUP), answer.content
    for call in answer.tool_calls:
        assert call["name"] == "get_weather" and "city" in call["args"]
    forced = llm.bind_tools([get_weather], tool_choice="get_weather", **kw)
    answer = forced.invoke("What is the weather in Paris?")
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "get_weather"
    assert "city" in answer.tool_calls[0]["args"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(api_base: str, method: str) -> None:
    llm = _chat_openai(api_base, max_tokens=48, temperature=0)
    structured = llm.with_structured_output(City, method=method)
    city = structured.invoke("Name a city and its country.")
    assert isinstance(city, City) and city.name and city.country


# --- litellm --------------------------------------------------------------------------


def test_litellm_completion_and_stream(api_base: str) -> None:
    litellm = pytest.importorskip("litellm")
    kw: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": api_base,
        "api_key": "unused",
        "messages": QUESTION,
        "max_tokens": 12,
        "temperature": 0,
    }
    answer = litellm.completion(**kw)
    text = answer.choices[0].message.content
    assert text and answer.usage.completion_tokens > 0
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in litellm.completion(stream=True, **kw)
    )
    assert streamed == text
