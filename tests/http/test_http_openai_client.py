"""The official `openai` client against the real server and the fake node."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.http.fake_node import FakeNode
from tests.http.http_harness import make_config, run, serving


def _client(url: str, key: str = "test-key") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key=key,
        max_retries=0,
        http_client=httpx.AsyncClient(http2=True, timeout=10),  # type: ignore[arg-type]
    )


def test_openai_client_chat_completion_streaming_and_usage(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("test-key\n")

    async def body() -> None:
        node = FakeNode()
        async with serving(node, make_config(api_key_file=str(key_file))) as srv:
            client = _client(srv.url)
            async with client:
                models = await client.models.list()
                assert [m.id for m in models.data] == ["fake-model"]

                chat = await client.chat.completions.create(
                    model="fake-model",
                    messages=[
                        {"role": "developer", "content": "be brief"},
                        {"role": "user", "content": "hi"},
                    ],
                    max_completion_tokens=8,
                    temperature=0,
                    seed=1,
                    logprobs=True,
                    top_logprobs=2,
                )
                assert chat.choices[0].message.content == "Hello, world!"
                assert chat.choices[0].finish_reason == "stop"
                assert chat.choices[0].logprobs is not None
                assert chat.choices[0].logprobs.content is not None
                assert chat.choices[0].logprobs.content[0].top_logprobs[1].token == "alt1"
                assert chat.usage is not None and chat.usage.total_tokens == 11
                assert (
                    node.jobs[-1].messages is not None
                    and node.jobs[-1].messages[0].role == "system"
                )

                completion = await client.completions.create(
                    model="fake-model", prompt="Say", max_tokens=3, stop=["\n"]
                )
                assert completion.choices[0].text == "Hello, world"
                assert completion.choices[0].finish_reason == "length"
                assert completion.usage is not None and completion.usage.completion_tokens == 3

                stream = await client.chat.completions.create(
                    model="fake-model",
                    messages=[{"role": "user", "content": "hi"}],
                    stream=True,
                    stream_options={"include_usage": True},
                )
                text, usage, reasons = "", None, []
                async for chunk in stream:
                    for choice in chunk.choices:
                        text += choice.delta.content or ""
                        reasons.append(choice.finish_reason)
                    if chunk.usage is not None:
                        usage = chunk.usage
                assert text == "Hello, world!"
                assert reasons[-1] == "stop"
                assert (
                    usage is not None and usage.prompt_tokens == 7 and usage.completion_tokens == 4
                )

                cstream = await client.completions.create(
                    model="fake-model", prompt="x", stream=True
                )
                pieces = [c.choices[0].text async for c in cstream]
                assert "".join(pieces) == "Hello, world!"

    run(body)


def test_openai_client_sees_errors_as_its_exceptions(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("test-key\n")

    async def body() -> None:
        node = FakeNode()
        async with serving(node, make_config(api_key_file=str(key_file))) as srv:
            async with _client(srv.url, key="wrong") as client:
                with pytest.raises(openai.AuthenticationError):
                    await client.models.list()
            async with _client(srv.url) as client:
                with pytest.raises(openai.NotFoundError) as not_found:
                    await client.chat.completions.create(
                        model="nope", messages=[{"role": "user", "content": "x"}]
                    )
                assert not_found.value.code == "model_not_found"
                with pytest.raises(openai.BadRequestError) as bad:
                    await client.chat.completions.create(
                        model="fake-model",
                        messages=[{"role": "user", "content": "x"}],
                        tools=[{"type": "function", "function": {"name": "f"}}],
                        tool_choice={"type": "function", "function": {"name": "g"}},
                    )
                assert bad.value.param == "tool_choice"
                node.fail_at = 1
                stream = await client.chat.completions.create(
                    model="fake-model", messages=[{"role": "user", "content": "x"}], stream=True
                )
                with pytest.raises(openai.APIError, match="wedged"):
                    async for _ in stream:
                        pass

    run(body)
