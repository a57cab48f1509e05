"""Issue 47 (#1, #2): tenants as configuration, isolated by default.

Each test fails on the code before: there was no `[[tenants]]` table (an unknown key), the
prefix cache was shared between keys unless the operator asked otherwise, no job knew its
tenant's name, and no key could act for another tenant.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from neuron_trio.config import NeuronConfig, config_from_mapping
from neuron_trio.errors import ConfigError
from neuron_trio.http.tenancy import TenantDirectory, job_cache_salt, key_tenant_name
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h2_client, make_config, run, serving
from tests.http.tenant_keys import auth_headers, tenants_config


async def _post(client: Any, headers: dict[str, str]) -> Any:
    return await client.post("/v1/chat/completions", json=chat_body(), headers=headers)


def test_keys_of_api_key_file_are_isolated_by_default(tmp_path: Path) -> None:
    """The shipped default shared the prefix cache between keys: a right guess of another
    tenant's prompt answered in 0.5 s against 7-16 s for wrong ones."""
    (tmp_path / "api").write_text("key-one\nkey-two\n")
    node = FakeNode()

    async def body() -> None:
        config = make_config(api_key_file=str(tmp_path / "api"))
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            for key in ("key-one", "key-two"):
                assert (await _post(client, auth_headers(key))).status_code == 200

    run(body)
    one, two = node.jobs
    assert one.cache_salt is not None and two.cache_salt is not None
    assert one.cache_salt != two.cache_salt
    assert one.tenant == key_tenant_name(b"key-one") and one.tenant.startswith("key-")
    assert b"key-one" not in one.cache_salt and "key-one" not in one.tenant


def test_tenants_from_the_config_name_every_job_and_share_only_by_group(tmp_path: Path) -> None:
    node = FakeNode()

    async def body() -> None:
        config = tenants_config(tmp_path)
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            for key in ("alpha-1", "alpha-2", "beta-1", "gamma-1", "the-admin"):
                assert (await _post(client, auth_headers(key))).status_code == 200

    run(body)
    assert [job.tenant for job in node.jobs] == ["alpha", "alpha", "beta", "gamma", "operator"]
    a1, a2, beta, gamma, admin = (job.cache_salt for job in node.jobs)
    assert a1 == a2  # two keys of one tenant: one cache
    assert beta == gamma  # one prefix_cache_group
    assert len({a1, beta, admin}) == 3 and None not in {a1, beta, admin}


def test_an_admin_key_acts_for_a_tenant_named_in_the_header(tmp_path: Path) -> None:
    node = FakeNode()

    async def body() -> None:
        config = tenants_config(tmp_path)
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            assert (await _post(client, auth_headers("the-admin", "routed"))).status_code == 200
            assert (await _post(client, auth_headers("the-admin", "alpha"))).status_code == 200
            r = await _post(client, auth_headers("the-admin", "nobody"))
            assert r.status_code == 400 and "X-Neuron-Tenant" in r.json()["error"]["message"]

    run(body)
    assert [job.tenant for job in node.jobs] == ["routed", "alpha"]


@pytest.mark.parametrize("key", ["alpha-1", "beta-1"])
def test_any_other_key_sending_the_tenant_header_gets_a_403_naming_it(
    tmp_path: Path, key: str
) -> None:
    node = FakeNode()

    async def body() -> None:
        config = tenants_config(tmp_path)
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            r = await _post(client, auth_headers(key, "gamma"))
            assert r.status_code == 403
            assert "X-Neuron-Tenant" in r.json()["error"]["message"]
            assert r.json()["error"]["code"] == "tenant_header_forbidden"

    run(body)
    assert node.jobs == []


def test_without_keys_there_is_no_tenant_and_no_tenant_salt() -> None:
    node = FakeNode()

    async def body() -> None:
        async with serving(node) as srv, h2_client(srv.url) as client:
            assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200

    run(body)
    assert node.jobs[0].tenant is None and node.jobs[0].cache_salt is None


def test_a_tenant_key_alone_opens_the_api_and_may_listen_widely(tmp_path: Path) -> None:
    (tmp_path / "alpha").write_text("alpha-1\n")
    data = {
        "server": {"listen": ["0.0.0.0:8080"]},
        "tenants": [{"name": "alpha", "keys_file": str(tmp_path / "alpha")}],
    }
    config = config_from_mapping(data, origin="t.toml", environ={})
    directory = TenantDirectory.from_config(config)
    assert directory.lookup(b"alpha-1") == "alpha" and directory.lookup(b"alpha-") is None

    async def body() -> None:
        async with serving(FakeNode(), make_tenants(config)) as srv, h2_client(srv.url) as c:
            assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 401
            assert (await _post(c, auth_headers("alpha-1"))).status_code == 200

    run(body)


def make_tenants(config: NeuronConfig) -> NeuronConfig:
    """`config` listening on loopback, port 0, as the harness serves."""
    return NeuronConfig(server=make_config().server, tenants=config.tenants)


@pytest.mark.parametrize(
    ("tenants", "key"),
    [
        ([{"name": "a"}, {"name": "a"}], "tenants[1].name"),
        ([{"name": "key-1234"}], "tenants[0].name"),
        ([{"name": "operator"}], "tenants[0].name"),
        ([{"name": "bad name"}], "tenants[0].name"),
        ([{"name": "a", "keys_file": "/no/such/file"}], "tenants[0].keys_file"),
        ([{"name": "a", "weight": 0}], "tenants[0].weight"),
        ([{"name": "a", "api_key": "secret"}], "tenants[0].api_key"),
    ],
)
def test_bad_tenants_name_the_key(tenants: list[dict[str, Any]], key: str) -> None:
    with pytest.raises(ConfigError, match=f"key {re.escape(key)}"):
        config_from_mapping({"tenants": tenants}, origin="t.toml", environ={})


def test_keys_never_appear_in_the_config_document(tmp_path: Path) -> None:
    """Keys are given as files: the config (which /v1/node shows operators) names paths."""
    config = tenants_config(tmp_path)
    import msgspec

    text = msgspec.json.encode(config).decode()
    assert "alpha-1" not in text and "the-admin" not in text
    assert job_cache_salt(b"tenant:alpha", None) is not None


# --- stored responses belong to their tenant ------------------------------------------------


def _respond(client: Any, key: str, **extra: Any) -> Any:
    doc = {"model": "fake-model", "input": "my secret plan", **extra}
    return client.post("/v1/responses", json=doc, headers=auth_headers(key))


def test_another_tenant_gets_404_on_get_delete_and_previous_response_id(tmp_path: Path) -> None:
    """Before: any other key could read, chain (its conversation landing in the other
    tenant's prompt) and delete a stored response."""
    node = FakeNode()

    async def body() -> None:
        config = tenants_config(tmp_path)
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            rid = (await _respond(client, "alpha-1")).json()["id"]
            path = f"/v1/responses/{rid}"
            assert (await client.get(path, headers=auth_headers("beta-1"))).status_code == 404
            assert (await client.delete(path, headers=auth_headers("beta-1"))).status_code == 404
            r = await _respond(client, "beta-1", previous_response_id=rid)
            assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
            # the same 404 as an id never issued
            never = await client.get("/v1/responses/resp_never", headers=auth_headers("beta-1"))
            assert never.json()["error"]["code"] == r.json()["error"]["code"]
            # the owner's other key still has it, chains from it and deletes it
            assert (await client.get(path, headers=auth_headers("alpha-2"))).status_code == 200
            r = await _respond(client, "alpha-2", previous_response_id=rid)
            assert r.status_code == 200
            assert (await client.delete(path, headers=auth_headers("alpha-1"))).status_code == 200

    run(body)
    assert [job.tenant for job in node.jobs] == ["alpha", "alpha"]  # beta's never ran


def test_one_tenant_cannot_evict_another_tenants_responses() -> None:
    from neuron_trio.http.response_store import ResponseStore

    store = ResponseStore(max_responses=2, max_bytes=10_000)
    store.put("kept", ({"role": "user", "content": "x"},), {"id": "kept"}, owner="alpha")
    for i in range(50):
        store.put(f"flood{i}", ({"role": "user", "content": "y"},), {}, owner="beta")
    assert store.get("kept", owner="alpha").document == {"id": "kept"}
    assert len(store) == 3


def test_the_access_log_names_the_tenant_never_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="neuron_trio.access")

    async def body() -> None:
        config = tenants_config(tmp_path)
        async with serving(FakeNode(), config) as srv, h2_client(srv.url) as client:
            assert (await _post(client, auth_headers("alpha-1"))).status_code == 200
            assert (await _post(client, auth_headers("alpha-1", "beta"))).status_code == 403

    run(body)
    lines = [r.getMessage() for r in caplog.records if r.name == "neuron_trio.access"]
    assert len(lines) == 2 and all("tenant=alpha" in line for line in lines), lines
    assert not any("alpha-1" in r.getMessage() for r in caplog.records)
