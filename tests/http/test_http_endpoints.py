"""`GET /v1/models/{id}`, `system_fingerprint`, and `/v1/completions` with several prompts and
`echo`, against the fake node."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from neuron_trio.service.documents.fingerprint import EDGE_BYTES, model_fingerprint
from tests.http.error_body import assert_error
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h2_client, run, serving, sse_events


def _fingerprinted() -> FakeNode:
    node = FakeNode()
    node.models["fake-model"] = replace(node.models["fake-model"], fingerprint="fp_0123")
    return node


def test_models_retrieve_and_unknown_model() -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            r = await client.get("/v1/models/fake-model")
            assert r.status_code == 200
            doc = r.json()
            assert doc["id"] == "fake-model" and doc["object"] == "model"
            assert doc["created"] == 1_700_000_000 and doc["owned_by"] == "neuron"
            err = assert_error(await client.get("/v1/models/nope"), 404, param="model")
            assert err["code"] == "model_not_found" and "nope" in err["message"]

    run(body)


def test_system_fingerprint_on_bodies_and_chunks() -> None:
    async def body() -> None:
        async with serving(_fingerprinted()) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body())
            assert r.json()["system_fingerprint"] == "fp_0123"
            r = await client.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True}
            )
            chunks = [c for c in sse_events(r.text) if c != "[DONE]"]
            assert chunks and all(c["system_fingerprint"] == "fp_0123" for c in chunks)
            r = await client.post(
                "/v1/completions", json={"model": "fake-model", "prompt": ["x", "y"]}
            )
            assert r.json()["system_fingerprint"] == "fp_0123"

    run(body)


def test_model_fingerprint_is_stable_and_follows_file_and_dtype(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * (EDGE_BYTES // 128))  # > 2 edges
    first = model_fingerprint(path, "auto")
    assert first == model_fingerprint(path, "auto") and first.startswith("fp_")
    assert model_fingerprint(path, "float32") != first
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last tensor's bytes
    path.write_bytes(bytes(data))
    assert model_fingerprint(path, "auto") != first


def test_completions_with_a_list_of_prompts() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            doc = {"model": "fake-model", "prompt": ["a", [5, 6]], "n": 2, "max_tokens": 3}
            r = await client.post("/v1/completions", json=doc)
            assert r.status_code == 200, r.text
            out = r.json()
            assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
            # the fake answers choice 0 of each prompt only (it ignores n): p·n + 0
            assert [c["text"] for c in out["choices"]] == ["Hello, world", "", "Hello, world", ""]
            assert out["choices"][2]["finish_reason"] == "length"
            # the fake counts 7 prompt tokens and 3 completion tokens per prompt
            assert out["usage"] == {"prompt_tokens": 14, "completion_tokens": 6, "total_tokens": 20}
            assert [j.prompt for j in node.jobs] == ["a", None]
            assert node.jobs[1].prompt_ids == (5, 6)

    run(body)


def test_streamed_list_of_prompts_numbers_choices_across_prompts() -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            doc = {
                "model": "fake-model",
                "prompt": ["a", "b", "c"],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            r = await client.post("/v1/completions", json=doc)
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["prompt_tokens"] == 21
            texts: dict[int, str] = {}
            finished = set()
            for chunk in events[:-2]:
                (choice,) = chunk["choices"]
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"] is not None:
                    finished.add(choice["index"])
            assert texts == {i: "Hello, world!" for i in range(3)}
            assert finished == {0, 1, 2}

    run(body)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_each_choice(stream: bool) -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            doc = {"model": "fake-model", "prompt": ["Say: ", "Q"], "echo": True, "stream": stream}
            r = await client.post("/v1/completions", json=doc)
            assert r.status_code == 200, r.text
            if not stream:
                texts = {c["index"]: c["text"] for c in r.json()["choices"]}
            else:
                texts = {}
                for chunk in sse_events(r.text)[:-1]:
                    (c,) = chunk["choices"]
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            assert texts == {0: "Say: Hello, world!", 1: "QHello, world!"}

    run(body)


def test_a_failing_prompt_fails_the_batch_without_a_traceback() -> None:
    async def body() -> None:
        node = FakeNode()
        node.fail_at = 1
        async with serving(node) as srv, h2_client(srv.url) as client:
            doc = {"model": "fake-model", "prompt": ["a", "b"]}
            err = assert_error(await client.post("/v1/completions", json=doc), 503)
            assert err["code"] == "wedged"
            r = await client.post("/v1/completions", json={**doc, "stream": True})
            events = sse_events(r.text)
            assert events[-1]["error"]["code"] == "wedged"
            assert node.open == 0

    run(body)
