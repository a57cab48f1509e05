"""Tenants for the HTTP tests: `tenants_config` writes the key files of four tenants (alpha,
weighted 2; beta and gamma sharing a prefix-cache group; routed, keyless) and an admin key;
`auth_headers` makes the headers that present a key, and a tenant for an admin key to route to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuron_trio.config import NeuronConfig, TenantConfig
from tests.http.http_harness import make_config


def auth_headers(key: str, tenant: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    if tenant is not None:
        headers["X-Neuron-Tenant"] = tenant
    return headers


def tenants_config(tmp_path: Path, **server: Any) -> NeuronConfig:
    (tmp_path / "alpha").write_text("alpha-1\nalpha-2\n")
    (tmp_path / "beta").write_text("beta-1\n")
    (tmp_path / "gamma").write_text("gamma-1\n")
    (tmp_path / "admin").write_text("the-admin\n")
    config = make_config(admin_key_file=str(tmp_path / "admin"), **server)
    tenants = [
        TenantConfig(name="alpha", keys_file=str(tmp_path / "alpha"), weight=2.0),
        TenantConfig(name="beta", keys_file=str(tmp_path / "beta"), prefix_cache_group="shared"),
        TenantConfig(name="gamma", keys_file=str(tmp_path / "gamma"), prefix_cache_group="shared"),
        TenantConfig(name="routed"),  # no keys: reached through an admin key's header
    ]
    return NeuronConfig(server=config.server, tenants=tenants)
