"""`/v1/completions` `echo` with `logprobs` (the prompt's tokens and their logprobs before the
completion's, the first null) and `echo` with token ids (their text), over the fake node: one
token a character, every prompt token's logprob -1 (tests/http/fake_node.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.http.fake_node import FakeNode
from tests.http.http_harness import h2_client, run, serving, sse_events


def _choices(raw: Any, stream: bool) -> dict[int, dict[str, Any]]:
    """Each choice's text and logprobs lists, streamed chunks joined."""
    if not stream:
        return {c["index"]: c for c in raw.json()["choices"]}
    out: dict[int, dict[str, Any]] = {}
    for chunk in sse_events(raw.text)[:-1]:
        for c in chunk["choices"]:
            got = out.setdefault(c["index"], {"text": "", "logprobs": None})
            got["text"] += c["text"]
            if c["logprobs"] is not None:
                if got["logprobs"] is None:
                    got["logprobs"] = {k: [] for k in c["logprobs"]}
                for k, v in c["logprobs"].items():
                    got["logprobs"][k] += v
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_puts_the_prompt_tokens_first(stream: bool) -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            doc = {"model": "fake-model", "prompt": ["Say", [81, 63]], "echo": True,
                   "logprobs": 1, "max_tokens": 2, "stream": stream}  # fmt: skip
            r = await client.post("/v1/completions", json=doc)
            assert r.status_code == 200, r.text
            assert all(j.params.prompt_logprobs for j in node.jobs)
            choices = _choices(r, stream)
            assert choices[0]["text"] == "SayHello,"
            assert choices[1]["text"] == "Q?Hello,"  # token ids echoed as their text
            lp = choices[0]["logprobs"]
            assert lp["tokens"] == ["S", "a", "y", "Hello", ","]
            assert lp["token_logprobs"] == [None, -1.0, -1.0, -0.5, -0.5]
            assert lp["top_logprobs"][0] is None
            assert lp["top_logprobs"][1] == {"a": -1.0}
            assert len(lp["top_logprobs"][3]) == 1  # the completion's, as before
            assert lp["text_offset"] == [0, 1, 2, 3, 8]  # one text: prompt, then completion
            assert choices[1]["logprobs"]["text_offset"] == [0, 1, 2, 7]

    run(body)


def test_echo_without_logprobs_asks_no_prompt_logprobs() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            doc = {"model": "fake-model", "prompt": [72, 105], "echo": True, "max_tokens": 1}
            r = await client.post("/v1/completions", json=doc)
            assert r.json()["choices"][0]["text"] == "HiHello"
            assert r.json()["choices"][0]["logprobs"] is None
            assert not node.jobs[0].params.prompt_logprobs
            lone = {"model": "fake-model", "prompt": "x", "logprobs": 1, "max_tokens": 1}
            await client.post("/v1/completions", json=lone)
            assert not node.jobs[1].params.prompt_logprobs  # only echo shows the prompt's

    run(body)
