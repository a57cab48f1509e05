"""vLLM's OpenAI-server tests (tests/entrypoints/openai/completion/test_completion.py and
chat_completion/test_chat.py), the cases that apply, ported to a real neuron with the async
openai client, as vLLM runs them.

Ported: single completions (text and token ids) and their usage, no/zero/some/too many
logprobs (completions and chat), streaming equals non-streaming with one finish reason,
parallel sampling (`n`, plain and streamed), `stream_options` (usage only when asked, and
only with `stream`), batches of prompts (text and ids; plain, `n = 2` and streamed),
`echo` (with `logprobs`, text and token ids), invalid structured-output requests, a chat session over two turns, a JSON schema.

Not ported, and why:
- LoRA adapters (`zephyr-lora`), `prompt_logprobs` (as a field of its own; `echo` with
  `logprobs` returns the prompt's, below), `truncate_prompt_tokens`,
  `truncation_side`, `return_token_ids`, `continuous_usage_stats`, `min_tokens`,
  `min_characters`, `use_beam_search`, `structured_outputs` (choice/regex/grammar): vLLM
  extensions; neuron answers a 400 naming each (checked for `structured_outputs` below);
- `prompt_tokens_details.cached_tokens`: neuron does not report cached prompt tokens per
  request (its prefix-cache hits are in `/metrics`);
- "subrequests finished at different times" (n = 3, 50 tokens): with the small max_tokens
  kept here for speed, every choice may well run to the limit.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import trio

from tests.conformance.conftest import MODEL

MESSAGES = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is 1+1?"},
]


# The chat the streaming tests send both ways (greedy: the stream must equal the body).
GREEDY_CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": MESSAGES,
    "max_completion_tokens": 10,
    "temperature": 0.0,
}


def run(fn: Any) -> None:
    async def main() -> None:
        with trio.fail_after(300):
            await fn()

    trio.run(main)


def _client(api_base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="dummy", base_url=api_base, max_retries=0, timeout=120)


async def _all(stream: AsyncIterator[Any]) -> list[Any]:
    return [chunk async for chunk in stream]


# --- completions ----------------------------------------------------------------------


def test_single_completion(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            completion = await client.completions.create(
                model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0.0
            )
            assert completion.id is not None and len(completion.choices) == 1
            usage = completion.usage
            assert usage is not None and usage.prompt_tokens > 0
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            if completion.choices[0].finish_reason == "length":
                assert usage.completion_tokens == 5
            ids = await client.completions.create(
                model=MODEL, prompt=[1, 504, 1256, 314], max_tokens=5, temperature=0.0
            )
            assert ids.choices[0].text is not None
            assert ids.usage is not None and ids.usage.prompt_tokens == 4

    run(body)


@pytest.mark.parametrize("logprobs,expect", [(None, None), (0, (0, 1)), (5, (5, 6))])
def test_completion_logprobs(api_base: str, logprobs: int | None, expect: Any) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            completion = await client.completions.create(
                model=MODEL,
                prompt=[1, 504, 1256],
                max_tokens=5,
                temperature=0.0,
                logprobs=logprobs,
            )
            choice = completion.choices[0]
            if expect is None:
                assert choice.logprobs is None
                return
            assert choice.logprobs is not None
            assert choice.logprobs.token_logprobs is not None
            assert choice.logprobs.top_logprobs is not None
            assert expect[0] <= len(choice.logprobs.top_logprobs[0]) <= expect[1]

    run(body)


def test_too_many_completion_logprobs(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(
                    model=MODEL, prompt=[1, 504], max_tokens=5, logprobs=21
                )
            with pytest.raises(openai.BadRequestError):
                await _all(
                    await client.completions.create(
                        model=MODEL, prompt=[1, 504], max_tokens=5, logprobs=30, stream=True
                    )
                )
            completion = await client.completions.create(model=MODEL, prompt=[1, 504], max_tokens=5)
            assert completion.choices[0].text is not None  # still serving

    run(body)


def test_completion_streaming(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            kw: dict[str, Any] = {"model": MODEL, "prompt": "What is an LLM?", "max_tokens": 5}
            single = await client.completions.create(temperature=0.0, **kw)
            chunks = await _all(await client.completions.create(temperature=0.0, stream=True, **kw))
            assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
            assert chunks[-1].choices[0].finish_reason == single.choices[0].finish_reason
            assert "".join(c.choices[0].text for c in chunks) == single.choices[0].text

    run(body)


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_sampling(api_base: str, stream: bool) -> None:
    async def body() -> None:
        n = 3
        async with _client(api_base) as client:
            kw: dict[str, Any] = {
                "model": MODEL,
                "prompt": "What is an LLM?",
                "max_tokens": 16,
                "n": n,
                "temperature": 1.0,
                "seed": 42,
            }
            texts = [""] * n
            finishes = 0
            if stream:
                for chunk in await _all(await client.completions.create(stream=True, **kw)):
                    choice = chunk.choices[0]
                    texts[choice.index] += choice.text
                    finishes += choice.finish_reason is not None
            else:
                completion = await client.completions.create(logprobs=0, **kw)
                assert [c.index for c in completion.choices] == list(range(n))
                for choice in completion.choices:
                    texts[choice.index] = choice.text
                    finishes += choice.finish_reason is not None
            assert finishes == n
            assert len(set(texts)) == n, texts

    run(body)


def test_completion_stream_options(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            kw: dict[str, Any] = {
                "model": MODEL,
                "prompt": "What is the capital of France?",
                "max_tokens": 5,
                "temperature": 0.0,
            }
            for chunk in await _all(
                await client.completions.create(
                    stream=True, stream_options={"include_usage": False}, **kw
                )
            ):
                assert chunk.usage is None
            chunks = await _all(
                await client.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw
                )
            )
            assert all(c.usage is None for c in chunks[:-1])
            final = chunks[-1]
            assert final.choices == [] and final.usage is not None
            assert final.usage.total_tokens == (
                final.usage.prompt_tokens + final.usage.completion_tokens
            )
            # stream_options without stream: a 400, as vLLM answers (issue 26 item 3)
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(
                    stream=False, stream_options={"include_usage": True}, **kw
                )

    run(body)


def test_batch_completions(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            for prompts in (["Hello, my name is"] * 2, [[1, 504, 1256, 314]] * 2):
                kw: dict[str, Any] = {
                    "model": MODEL,
                    "prompt": prompts,
                    "max_tokens": 5,
                    "temperature": 0.0,
                }
                batch = await client.completions.create(**kw)
                assert len(batch.choices) == 2
                assert batch.choices[0].text == batch.choices[1].text
                paired = await client.completions.create(n=2, **kw)
                assert [c.index for c in paired.choices] == [0, 1, 2, 3]
                # greedy: every choice of the same prompt is the same text
                assert len({c.text for c in paired.choices}) == 1
                texts = ["", ""]
                for chunk in await _all(await client.completions.create(stream=True, **kw)):
                    assert len(chunk.choices) == 1
                    texts[chunk.choices[0].index] += chunk.choices[0].text
                assert texts[0] == texts[1] == batch.choices[0].text

    run(body)


def test_echo_completion(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            prompt = "Hello, my name is"
            completion = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0, echo=True
            )
            assert completion.choices[0].text.startswith(prompt)

    run(body)


@pytest.mark.parametrize("logprobs_arg", [1, 3])
def test_echo_logprob_completion(api_base: str, tokenize: Any, logprobs_arg: int) -> None:
    """vLLM's test_echo_logprob_completion: text and token-id prompts (vLLM's `[0] * 5`
    ids are the built-in model's first token here too)."""

    async def body() -> None:
        async with _client(api_base) as client:
            for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
                completion = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
                    logprobs=logprobs_arg,
                )  # fmt: skip
                ids = tokenize(prompt) if isinstance(prompt, str) else prompt
                text = completion.choices[0].text
                if isinstance(prompt, str):
                    assert text.startswith(prompt)
                logprobs = completion.choices[0].logprobs
                assert logprobs is not None
                assert logprobs.tokens is not None and logprobs.text_offset is not None
                assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
                assert len(logprobs.text_offset) > 5
                assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None
                assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None
                for top_logprobs in logprobs.top_logprobs[1:]:
                    assert max(logprobs_arg, 1) <= len(top_logprobs) <= logprobs_arg + 1
                assert len(logprobs.tokens) > 5
                # neuron's own: the prompt's tokens first, then the completion's
                completion_tokens = completion.usage.completion_tokens if completion.usage else 0
                assert len(logprobs.tokens) == len(ids) + completion_tokens
                assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])

    run(body)


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"json": {"type": "object", "properties": {"foo": "bar"}}}},
        {"structured_outputs": {"regex": "[.*"}},
        {"structured_outputs": {"grammar": "root ::= select_statementinvalidsyntax"}},
    ],
)
def test_invalid_structured_output_requests(api_base: str, extra: dict[str, Any]) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(
                    model=MODEL, prompt="Generate", max_tokens=5, extra_body=extra
                )

    run(body)


# --- chat -----------------------------------------------------------------------------


@pytest.mark.parametrize("top_logprobs", [None, 0, 5])
def test_chat_logprobs(api_base: str, top_logprobs: int | None) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            kw: dict[str, Any] = {}
            if top_logprobs is not None:
                kw = {"logprobs": True, "top_logprobs": top_logprobs}
            chat = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_completion_tokens=5,  # type: ignore[arg-type]
                temperature=0.0,
                **kw,
            )
            logprobs = chat.choices[0].logprobs
            if top_logprobs is None:
                assert logprobs is None
            else:
                assert logprobs is not None and logprobs.content is not None
                assert len(logprobs.content[0].top_logprobs) == top_logprobs

    run(body)


def test_too_many_chat_logprobs(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            kw: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 10}
            with pytest.raises(openai.BadRequestError):
                await _all(
                    await client.chat.completions.create(
                        logprobs=True, top_logprobs=21, stream=True, **kw
                    )
                )
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(logprobs=True, top_logprobs=30, **kw)
            chat = await client.chat.completions.create(**kw)
            assert chat.choices[0].message.content is not None

    run(body)


def test_single_chat_session(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            messages: list[Any] = list(MESSAGES)
            chat = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_completion_tokens=5,
                logprobs=True,
                top_logprobs=5,
            )
            assert chat.id is not None and len(chat.choices) == 1
            usage = chat.usage
            assert usage is not None and usage.completion_tokens <= 5
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            message = chat.choices[0].message
            assert message.role == "assistant" and message.content is not None
            messages.append({"role": "assistant", "content": message.content})
            messages.append({"role": "user", "content": "express your result in json"})
            chat = await client.chat.completions.create(
                model=MODEL, messages=messages, max_completion_tokens=5
            )
            assert chat.choices[0].message.content is not None

    run(body)


def test_chat_streaming(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            kw = GREEDY_CHAT
            chat = await client.chat.completions.create(**kw)
            chunks = await _all(await client.chat.completions.create(stream=True, **kw))
            text = ""
            for chunk in chunks:
                delta = chunk.choices[0].delta
                if delta.role:
                    assert delta.role == "assistant"
                text += delta.content or ""
            assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
            assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
            assert text == chat.choices[0].message.content

    run(body)


def test_chat_completion_stream_options(api_base: str) -> None:
    async def body() -> None:
        async with _client(api_base) as client:
            kw = GREEDY_CHAT
            for chunk in await _all(
                await client.chat.completions.create(
                    stream=True, stream_options={"include_usage": False}, **kw
                )
            ):
                assert chunk.usage is None
            chunks = await _all(
                await client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw
                )
            )
            assert all(c.usage is None for c in chunks[:-1])
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(
                    stream=False, stream_options={"include_usage": True}, **kw
                )

    run(body)


def test_json_schema_chat(api_base: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "integer", "minimum": 0, "maximum": 99},
            "sure": {"type": "boolean"},
        },
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }

    async def body() -> None:
        async with _client(api_base) as client:
            chat = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_completion_tokens=32,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "sum", "schema": schema, "strict": True},
                },
            )
            doc = json.loads(chat.choices[0].message.content or "")
            assert set(doc) == {"answer", "sure"}
            assert isinstance(doc["answer"], int) and isinstance(doc["sure"], bool)

    run(body)


def test_named_tool_choice(api_base: str) -> None:
    """From chat_completion/test_completion_with_function_calling.py: a named tool_choice
    gives a call to that function whose arguments validate."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }

    async def body() -> None:
        async with _client(api_base) as client:
            chat = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Weather in Dallas in fahrenheit?"}],
                max_completion_tokens=96,
                tools=[tool],  # type: ignore[list-item]
                tool_choice={"type": "function", "function": {"name": "get_current_weather"}},
            )
            calls = chat.choices[0].message.tool_calls
            assert calls, chat.choices[0]
            assert calls[0].function.name == "get_current_weather"  # type: ignore[union-attr]
            args = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
            assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["city"], str)

    run(body)
