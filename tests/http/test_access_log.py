"""The access log: one line per request, with the model, token counts and errors."""

from __future__ import annotations

import logging

import pytest

from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h2_client, run, serving


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "neuron_trio.access"]


def test_one_line_per_request_with_tokens_and_errors(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="neuron_trio.access")

    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200
            r = await client.post("/v1/chat/completions", json=chat_body(stream=True))
            assert r.status_code == 200 and "[DONE]" in r.text
            bad = await client.post("/v1/chat/completions", json=chat_body(max_tokens=0))
            assert bad.status_code == 400
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200
            assert (await client.get("/v1/nope")).status_code == 404

    run(body)
    lines = _lines(caplog)
    assert len(lines) == 4, lines  # /health and /metrics are not logged
    plain, streamed, bad, missing = lines
    assert plain.startswith("POST /v1/chat/completions 200 ") and " h2 127.0.0.1 " in plain
    assert "model=fake-model prompt=7 completion=4 finish=stop" in plain
    assert "ttft=" not in plain  # a JSON response has no first token the client saw early
    assert "model=fake-model prompt=7 completion=4 finish=stop ttft=" in streamed
    assert bad.startswith("POST /v1/chat/completions 400 ")
    assert "model=" not in bad and 'error="max_tokens: Expected `int` >= 1"' in bad
    assert (
        missing.startswith("GET /v1/nope 404 ") and 'error="no route for GET /v1/nope"' in missing
    )
