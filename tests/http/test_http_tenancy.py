"""Issue 25 (#6, #10): prefix-cache salts per request and per tenant, /metrics and /v1/node
for operators only, bounded access-log fields.

Each test fails on the code before the fix: `cache_salt` was an unknown field (400), every
key shared one prefix cache, /metrics was open to anyone, /v1/node showed file paths to any
key, and a long `model` went whole into the access log.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from neuron_trio.http.tenancy import HIDDEN, job_cache_salt, key_tenant_name
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h2_client, make_config, run, serving


class PathNode(FakeNode):
    async def node_info(self) -> dict[str, Any]:
        doc = await super().node_info()
        doc["config"] = "/etc/neuron/neuron.toml"
        doc["last_forensics"] = {"path": "/var/lib/neuron/forensics/x.json"}
        doc["models"] = [
            {
                "name": "fake-model",
                "source": "/var/lib/neuron/models/secret-name.gguf",
                "path": "/var/lib/neuron/models/secret-name.gguf",
                "last_error": None,
                "kv_cache": {"prefix_cache_hits_tokens": 32, "prefix_cache_queries_tokens": 64},
            }
        ]
        return doc


def _keys(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "api").write_text("tenant-a\ntenant-b\n")
    (tmp_path / "admin").write_text("the-admin\n")
    (tmp_path / "metrics").write_text("the-scraper\n")
    return {
        "api_key_file": str(tmp_path / "api"),
        "admin_key_file": str(tmp_path / "admin"),
    }


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_cache_salt_reaches_the_job_on_both_routes_and_is_bounded() -> None:
    node = FakeNode()

    async def body() -> None:
        async with serving(node) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body(cache_salt="abc"))
            assert r.status_code == 200
            doc = {"model": "fake-model", "prompt": "hi", "cache_salt": "abc"}
            assert (await client.post("/v1/completions", json=doc)).status_code == 200
            assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200
            for bad in ("", "x" * 2000):
                r = await client.post("/v1/chat/completions", json=chat_body(cache_salt=bad))
                assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]

    run(body)
    salts = [job.cache_salt for job in node.jobs]
    assert salts == [job_cache_salt(None, b"abc")] * 2 + [None]


def test_api_key_isolation_gives_each_tenant_its_own_salt(tmp_path: Path) -> None:
    node = FakeNode()
    config = make_config(**_keys(tmp_path), prefix_cache_isolation="api_key")

    async def body() -> None:
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            for key, salt in [("tenant-a", None), ("tenant-b", None), ("tenant-a", "s")]:
                extra = {} if salt is None else {"cache_salt": salt}
                r = await client.post(
                    "/v1/chat/completions", json=chat_body(**extra), headers=_auth(key)
                )
                assert r.status_code == 200

    run(body)
    a, b, a_salted = (job.cache_salt for job in node.jobs)
    assert a == job_cache_salt(b"tenant:" + key_tenant_name(b"tenant-a").encode(), None)
    assert len({a, b, a_salted}) == 3 and None not in {a, b, a_salted}
    assert b"tenant-a" not in (a or b"")  # the key itself is never the salt


def test_without_isolation_keys_share_the_cache(tmp_path: Path) -> None:
    """`prefix_cache_isolation = "none"`: the operator's explicit opt-out (issue 47 made
    isolation the default)."""
    node = FakeNode()
    config = make_config(**_keys(tmp_path), prefix_cache_isolation="none")

    async def body() -> None:
        async with serving(node, config) as srv, h2_client(srv.url) as c:
            for key in ("tenant-a", "tenant-b"):
                r = await c.post("/v1/chat/completions", json=chat_body(), headers=_auth(key))
                assert r.status_code == 200

    run(body)
    assert [job.cache_salt for job in node.jobs] == [None, None]


def test_isolation_by_api_key_needs_api_keys() -> None:
    from neuron_trio.config import config_from_mapping
    from neuron_trio.errors import ConfigError

    with pytest.raises(ConfigError, match="prefix_cache_isolation"):
        config_from_mapping(
            {"server": {"prefix_cache_isolation": "api_key"}}, origin="t.toml", environ={}
        )


@pytest.mark.parametrize("with_metrics_key", [False, True])
def test_metrics_needs_an_operator_key_when_api_keys_are_set(
    tmp_path: Path, with_metrics_key: bool
) -> None:
    keys = _keys(tmp_path)
    if with_metrics_key:
        keys["metrics_key_file"] = str(tmp_path / "metrics")

    async def body() -> None:
        async with serving(FakeNode(), make_config(**keys)) as srv, h2_client(srv.url) as client:
            assert (await client.get("/metrics")).status_code == 401
            assert (await client.get("/metrics", headers=_auth("tenant-a"))).status_code == 401
            assert (await client.get("/metrics", headers=_auth("the-admin"))).status_code == 200
            scraper = await client.get("/metrics", headers=_auth("the-scraper"))
            assert scraper.status_code == (200 if with_metrics_key else 401)
            assert (await client.get("/health")).status_code == 200  # still open

    run(body)


def test_metrics_with_api_keys_only_takes_any_api_key(tmp_path: Path) -> None:
    (tmp_path / "api").write_text("k\n")

    async def body() -> None:
        config = make_config(api_key_file=str(tmp_path / "api"))
        async with serving(FakeNode(), config) as srv, h2_client(srv.url) as client:
            assert (await client.get("/metrics")).status_code == 401
            assert (await client.get("/metrics", headers=_auth("k"))).status_code == 200

    run(body)


def test_node_info_shows_paths_and_cache_counters_to_the_admin_only(tmp_path: Path) -> None:
    async def body() -> None:
        config = make_config(**_keys(tmp_path))
        async with serving(PathNode(), config) as srv, h2_client(srv.url) as client:
            tenant = (await client.get("/v1/node", headers=_auth("tenant-a"))).json()
            admin = (await client.get("/v1/node", headers=_auth("the-admin"))).json()
        assert "/var/lib" not in str(tenant) and "/etc/neuron" not in str(tenant)
        model = tenant["models"][0]
        assert model["path"] == HIDDEN and model["source"] == HIDDEN
        assert model["kv_cache"]["prefix_cache_hits_tokens"] is None
        assert tenant["last_forensics"] == HIDDEN
        assert admin["models"][0]["path"].startswith("/var/lib/neuron/models/")
        assert admin["models"][0]["kv_cache"]["prefix_cache_hits_tokens"] == 32

    run(body)


def test_a_huge_model_value_is_a_400_and_a_short_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="neuron_trio.access")

    async def body() -> None:
        async with serving(FakeNode()) as srv, h2_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body(model="m" * 900_000))
            assert r.status_code == 400 and len(r.content) < 1000
            r = await client.get("/v1/" + "p" * 5000 + "%0Aforged line")
            assert r.status_code == 404

    run(body)
    lines = [r.getMessage() for r in caplog.records if r.name == "neuron_trio.access"]
    assert len(lines) == 2 and all(len(line) < 1000 for line in lines), [len(x) for x in lines]
    assert all("\n" not in line for line in lines)
