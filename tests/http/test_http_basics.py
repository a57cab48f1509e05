"""Routes, errors, auth, limits and metrics over real sockets (HTTP/2 and HTTP/1.1)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from neuron_trio.errors import (
    ConfigError,
    PlacementError,
    QueueFullError,
    SourceError,
    UnavailableError,
    UnsupportedModelError,
)
from neuron_trio.http import create_app
from tests.http.error_body import assert_error
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h1_client, h2_client, make_config, run, serving


@pytest.mark.parametrize("status", ["ok", "starting", "draining", "recovering", "wedged"])
def test_health_reports_each_state(status: str) -> None:
    async def body() -> None:
        node = FakeNode()
        node.status = status  # type: ignore[assignment]
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.get("/health")
            assert r.http_version == "HTTP/2"
            assert r.status_code == (200 if status == "ok" else 503)
            doc = r.json()
            assert doc["status"] == status
            assert doc["boot_id"] == "b00t"
            assert doc["starts"] == 3
            assert doc["started_at"] == "2026-01-01T00:00:00Z"

    run(body)


def test_http1_and_http2_share_the_port() -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv:
            async with h1_client(srv.url) as c1:
                r1 = await c1.get("/health")
            async with h2_client(srv.url) as c2:
                r2 = await c2.get("/health")
            assert (r1.http_version, r2.http_version) == ("HTTP/1.1", "HTTP/2")
            assert srv.bound[0].port != 0 and srv.bound[0].scheme == "http"

    run(body)


def test_node_info_and_models_routes() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            info = (await client.get("/v1/node")).json()
            assert info["hostname"] == "fake-host"
            models = (await client.get("/v1/models")).json()
            assert models["object"] == "list"
            assert [m["id"] for m in models["data"]] == ["fake-model"]
            assert models["data"][0]["object"] == "model"

            r = await client.post(
                "/v1/models", json={"name": "second", "source": "builtin:smollm2-135m"}
            )
            assert r.status_code == 201, r.text
            assert node.loaded[0].name == "second"
            assert_error(await client.post("/v1/models", json={"name": "x"}), 400, param="source")
            assert_error(
                await client.post("/v1/models", json={"name": "x", "source": "a", "tp": 0}),
                400,
                param="tp",
            )
            assert_error(await client.post("/v1/models", json={"name": "x", "source": "bad:"}), 500)

            r = await client.delete("/v1/models/second")
            assert r.json() == {"id": "second", "object": "model", "deleted": True}
            assert node.unloaded == ["second"]
            assert_error(await client.delete("/v1/models/second"), 404, param="model")

    run(body)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (SourceError("not under model_dirs"), 400),
        (PlacementError("needs 9 GiB, 3 free"), 507),
        (UnsupportedModelError("m.gguf: architecture 'mamba' is not supported"), 422),
    ],
)
def test_load_errors_map_to_statuses(error: Exception, status: int) -> None:
    async def body() -> None:
        node = FakeNode()
        node.load_error = error
        async with serving(node) as srv, h2_client(srv.url) as client:
            err = assert_error(
                await client.post("/v1/models", json={"name": "x", "source": "y"}), status
            )
            assert str(error) in err["message"]

    run(body)


def test_error_bodies_for_unknown_route_wrong_method_and_bad_json() -> None:
    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            assert_error(await client.get("/nope"), 404)
            err = assert_error(await client.get("/v1/chat/completions"), 405)
            assert err["code"] == "method_not_allowed"
            r = await client.put("/v1/models")
            assert_error(r, 405)
            assert "POST" in r.headers["allow"]
            err = assert_error(
                await client.post("/v1/chat/completions", content=b'{"model": '), 400
            )
            assert err["code"] == "invalid_json"
            assert_error(await client.post("/v1/completions", content=b""), 400)

    run(body)


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize("http2", [True, False])
def test_body_limit_with_and_without_content_length(http2: bool) -> None:
    async def body() -> None:
        config = make_config(max_body_bytes=1000)
        async with serving(FakeNode(), config) as srv:
            make = h2_client if http2 else h1_client
            big = b'{"model": "fake-model", "prompt": "' + b"x" * 2000 + b'"}'
            async with make(srv.url) as client:
                err = assert_error(await client.post("/v1/completions", content=big), 413)
                assert "1000" in err["message"]
            async with make(srv.url) as client:
                # Streamed body: chunked on HTTP/1.1, no Content-Length on HTTP/2.
                r = await client.post("/v1/completions", content=_chunks(big, 300))
                assert "content-length" not in r.request.headers
                assert_error(r, 413)
            async with make(srv.url) as client:
                small = b'{"model": "fake-model", "prompt": "hi"}'
                r = await client.post("/v1/completions", content=_chunks(small, 10))
                assert r.status_code == 200, r.text

    run(body)


def test_api_key_guards_v1_and_metrics_but_not_health(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("s3cret-key\nrotated-key\n")

    async def body() -> None:
        config = make_config(api_key_file=str(key_file))
        async with serving(FakeNode(), config) as srv, h2_client(srv.url) as client:
            for path in ("/v1/models", "/v1/node"):
                r = await client.get(path)
                err = assert_error(r, 401)
                assert err["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
                assert_error(await client.get(path, headers={"Authorization": "Bearer wrong"}), 401)
                assert_error(
                    await client.get(path, headers={"Authorization": "Basic s3cret-key"}), 401
                )
                ok = await client.get(path, headers={"Authorization": "Bearer s3cret-key"})
                assert ok.status_code == 200
                ok = await client.get(path, headers={"Authorization": "Bearer rotated-key"})
                assert ok.status_code == 200
            assert_error(await client.post("/v1/chat/completions", json=chat_body()), 401)
            assert (await client.get("/health")).status_code == 200
            # /metrics tells one tenant of another's prefix-cache hits: a key (issue 25, #6)
            assert_error(await client.get("/metrics"), 401)
            ok = await client.get("/metrics", headers={"Authorization": "Bearer s3cret-key"})
            assert ok.status_code == 200

    run(body)


def test_an_empty_api_key_file_is_a_config_error(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="api_key_file"):
        create_app(FakeNode(), make_config(api_key_file=str(key_file)))


def test_queue_full_is_429_with_retry_after() -> None:
    async def body() -> None:
        node = FakeNode()
        node.enter_error = QueueFullError("queue of fake-model is full", retry_after_s=2)
        async with serving(node) as srv, h2_client(srv.url) as client:
            for stream in (False, True):
                r = await client.post("/v1/chat/completions", json=chat_body(stream=stream))
                err = assert_error(r, 429)
                assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
                assert r.headers["retry-after"] == "2"

    run(body)


def test_draining_refuses_inference_with_503_and_retry_after() -> None:
    async def body() -> None:
        node = FakeNode()
        node.draining = True
        node.status = "draining"
        async with serving(node) as srv, h2_client(srv.url) as client:
            for path, doc in (
                ("/v1/chat/completions", chat_body()),
                ("/v1/completions", {"model": "fake-model", "prompt": "x"}),
            ):
                r = await client.post(path, json=doc)
                err = assert_error(r, 503)
                assert err["code"] == "draining"
                assert int(r.headers["retry-after"]) >= 1
            assert not node.jobs
            assert (await client.get("/health")).status_code == 503
            assert (await client.get("/v1/models")).status_code == 200

    run(body)


def test_unavailable_model_is_503_with_retry_after() -> None:
    async def body() -> None:
        node = FakeNode()
        node.enter_error = UnavailableError(
            "fake-model is recovering", code="recovering", retry_after_s=7
        )
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
            assert assert_error(r, 503)["code"] == "recovering"
            assert r.headers["retry-after"] == "7"

    run(body)


def test_a_bug_is_a_generic_json_500(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(FakeNode):
        def list_models(self) -> Any:
            raise RuntimeError("secret internals")

    async def body() -> None:
        async with serving(Broken()) as srv, h2_client(srv.url) as client:
            err = assert_error(await client.get("/v1/models"), 500)
            assert "secret" not in err["message"]
            assert (await client.get("/health")).status_code == 200

    run(body)
    assert any("secret internals" in (r.exc_text or "") for r in caplog.records)


def _samples(text: str) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def test_metrics_count_requests_by_route_template_and_status() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h2_client(srv.url) as client:
            await client.get("/health")
            await client.get("/health")
            await client.delete("/v1/models/nothing-here")
            await client.get("/nope")
            await client.post("/v1/chat/completions", json=chat_body())
            r = await client.get("/metrics")
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/plain")
            samples = _samples(r.text)

        def count(route: str, status: str, method: str) -> float:
            return sum(
                s.value
                for s in samples["neuron_http_requests_total"]
                if s.labels == {"route": route, "status": status, "method": method}
            )

        assert count("/health", "200", "GET") == 2
        assert count("/v1/models/{name}", "404", "DELETE") == 1
        assert count("<unmatched>", "404", "GET") == 1
        assert count("/v1/chat/completions", "200", "POST") == 1
        buckets = [
            s
            for s in samples["neuron_http_request_duration_seconds_bucket"]
            if s.labels["route"] == "/health" and s.labels["le"] == "+Inf"
        ]
        assert buckets[0].value == 2
        # the /metrics request itself is in flight while it renders
        assert samples["neuron_http_requests_in_flight"][0].value == 1
        assert samples["neuron_build_info"][0].labels["version"]
        assert "fake_node_things_total" in samples  # the node's own collectors are there too

    run(body)


@pytest.mark.parametrize("http2", [True, False])
@pytest.mark.parametrize("path", ["/nope", "/v1/chat/completions", "/health"])
def test_early_response_with_unread_body_keeps_the_server_up(
    tmp_path: Path, path: str, http2: bool
) -> None:
    """hypercorn dies on HTTP/2 DATA for an ended stream; the middleware reads the body out first."""
    key_file = tmp_path / "api-key"
    key_file.write_text("k\n")

    async def body() -> None:
        config = make_config(api_key_file=str(key_file), max_body_bytes=10_000_000)
        big = b"x" * 300_000
        make = h2_client if http2 else h1_client
        async with serving(FakeNode(), config) as srv, make(srv.url) as client:
            for _ in range(3):
                r = await client.post(path, content=_chunks(big, 16_384))
                assert r.status_code in (401, 404, 405)
            assert (await client.get("/health")).status_code == 200

    run(body)
