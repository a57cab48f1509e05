"""CORS (`server.cors_allow_origins`): preflights without a key, headers for allowed origins only."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_trio.config import NeuronConfig, config_from_mapping
from neuron_trio.errors import ConfigError
from tests.http.error_body import assert_error
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h1_client, h2_client, make_config, run, serving

PAGE = "https://chat.example.com"
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
}


def _keyed(tmp_path: Path, **server: object) -> NeuronConfig:
    (tmp_path / "api").write_text("the-key\n")
    return make_config(api_key_file=str(tmp_path / "api"), **server)


def test_a_preflight_from_an_allowed_origin_needs_no_key(tmp_path: Path) -> None:
    async def body() -> None:
        node = FakeNode()
        config = _keyed(tmp_path, cors_allow_origins=[PAGE, "http://localhost:3000"])
        async with serving(node, config) as srv:
            for client in (h1_client(srv.url), h2_client(srv.url)):
                async with client:
                    r = await client.options("/v1/chat/completions", headers=PREFLIGHT)
                    assert r.status_code == 200, r.text
                    assert r.headers["access-control-allow-origin"] == PAGE
                    assert "POST" in r.headers["access-control-allow-methods"]
                    allowed = r.headers["access-control-allow-headers"].lower()
                    assert "authorization" in allowed and "x-stainless-os" in allowed
                    assert int(r.headers["access-control-max-age"]) > 0
                    assert "origin" in r.headers["vary"].lower()
        assert not node.jobs

    run(body)


def test_a_preflight_from_another_origin_is_refused(tmp_path: Path) -> None:
    async def body() -> None:
        config = _keyed(tmp_path, cors_allow_origins=[PAGE])
        async with serving(FakeNode(), config) as srv, h2_client(srv.url) as client:
            headers = {**PREFLIGHT, "Origin": "https://evil.example.net"}
            r = await client.options("/v1/chat/completions", headers=headers)
            assert_error(r, 400)
            assert "access-control-allow-origin" not in r.headers

    run(body)


def test_responses_carry_the_origin_for_allowed_origins_only(tmp_path: Path) -> None:
    async def body() -> None:
        node = FakeNode()
        config = _keyed(tmp_path, cors_allow_origins=[PAGE])
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            auth = {"Authorization": "Bearer the-key"}
            ok = await client.post(
                "/v1/chat/completions", json=chat_body(), headers={**auth, "Origin": PAGE}
            )
            assert ok.status_code == 200
            assert ok.headers["access-control-allow-origin"] == PAGE
            assert "origin" in ok.headers["vary"].lower()
            assert "retry-after" in ok.headers["access-control-expose-headers"].lower()
            # a page must be able to read why it failed: the 401 carries it too
            denied = await client.get("/v1/models", headers={"Origin": PAGE})
            assert denied.status_code == 401
            assert denied.headers["access-control-allow-origin"] == PAGE
            other = await client.get(
                "/v1/models", headers={**auth, "Origin": "https://evil.example.net"}
            )
            assert other.status_code == 200
            assert "access-control-allow-origin" not in other.headers
            plain = await client.get("/v1/models", headers=auth)  # no Origin: no CORS
            assert "access-control-allow-origin" not in plain.headers

    run(body)


def test_cors_is_off_by_default(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(FakeNode(), _keyed(tmp_path)) as srv, h2_client(srv.url) as client:
            r = await client.options("/v1/chat/completions", headers=PREFLIGHT)
            assert r.status_code == 401  # an OPTIONS like any other: the key first
            assert "access-control-allow-origin" not in r.headers
            ok = await client.get(
                "/v1/models", headers={"Authorization": "Bearer the-key", "Origin": PAGE}
            )
            assert "access-control-allow-origin" not in ok.headers

    run(body)


@pytest.mark.parametrize(
    "origins",
    [
        ["https://chat.example.com/"],  # a path (even "/") is not part of an origin
        ["chat.example.com"],
        ["ftp://chat.example.com"],
        ["https://chat.example.com:99999"],
        [""],
        ["https://" + "a" * 300 + ".com"],
        [f"https://h{i}.example.com" for i in range(65)],
    ],
)
def test_bad_origins_are_a_config_error_naming_the_key(origins: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"server\.cors_allow_origins"):
        config_from_mapping(
            {"server": {"cors_allow_origins": origins}}, origin="t.toml", environ={}
        )


def test_good_origins_load() -> None:
    origins = ["*", "http://localhost:3000", "https://chat.example.com", "http://[::1]:8080"]
    config = config_from_mapping(
        {"server": {"cors_allow_origins": origins}}, origin="t.toml", environ={}
    )
    assert config.server.cors_allow_origins == origins
