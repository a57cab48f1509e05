"""Who is asking: tenants (API keys) kept apart in the prefix cache, operators told more.

Issue 25 (#6, #10). A shared prefix cache is a timing oracle: a client guessing another's
system prompt saw its first token in 0.029 s on a right guess against 0.75-0.91 s on wrong
ones, and `/metrics` (open) showed the hit tokens exactly. So:

- `cache_salt` (a request field, as in vLLM) and, unless `server.prefix_cache_isolation =
  "none"`, the caller's tenant are folded into the job's salt (`job_cache_salt`): cached
  prompt blocks are shared only between requests with the same salt (engine/block_pool.py).
  The tenant part comes from authentication, so no `cache_salt` a client may send can equal
  another tenant's salt.
- The middleware marks each request with its tenant and whether its key is an operator's:
  the admin key when `admin_key_file` is set, else any key (or no key configured at all). `/v1/node` shows file paths, the last forensics report and the prefix
  cache's hit counters to operators only (`redact_node_info`).

Issue 47 (#1, #2): tenants are configuration (`[[tenants]]`: a name, a keys file, limits), and
every shared resource knows a request by its tenant's NAME (`tenant_name_of`), never its key.
`server.api_key_file` keeps working as one tenant per key (`key-<8 hex of its digest>`); an
admin key in no tenant's file is the tenant "operator". An admin key (or anyone, when no key
is configured at all) may act for a configured tenant named in `X-Neuron-Tenant` (a router
that authenticates its clients itself); any other key sending it gets a 403. The prefix cache
is per tenant by default (`TenantDirectory.cache_identity`; tenants of one
`prefix_cache_group` share).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.types import Scope

from neuron_trio.config import OPERATOR_TENANT, NeuronConfig, TenantConfig
from neuron_trio.errors import ConfigError

__all__ = [
    "OPERATOR_SCOPE_KEY",
    "TENANT_HEADER",
    "TENANT_NAME_SCOPE_KEY",
    "TenantDirectory",
    "is_operator",
    "job_cache_salt",
    "key_digest",
    "key_tenant_name",
    "read_api_keys",
    "redact_node_info",
    "tenant_name_of",
]

TENANT_NAME_SCOPE_KEY = "neuron.tenant_name"  # the tenant's name (str); absent: no keys
OPERATOR_SCOPE_KEY = "neuron.operator"
TENANT_HEADER = "X-Neuron-Tenant"
HIDDEN = "<hidden: needs the admin key>"


def key_digest(token: bytes) -> bytes:
    """A tenant's identity: a digest of its API key (the key itself is never kept)."""
    return hashlib.blake2b(token, digest_size=16, person=b"neuron-tenant").digest()


def tenant_name_of(scope: Scope) -> str | None:
    """The name of the tenant a request is served for; None when no key is configured."""
    value = scope.get(TENANT_NAME_SCOPE_KEY)
    return value if isinstance(value, str) else None


def key_tenant_name(token: bytes) -> str:
    """The tenant of one key of `server.api_key_file`: named by its digest, never by itself."""
    return "key-" + key_digest(token).hex()[:8]


def read_api_keys(path: str | None, key: str = "server.api_key_file") -> tuple[bytes, ...]:
    """The keys in `path` (a key file: `api_key_file`, `admin_key_file`, a tenant's
    `keys_file`): one per non-empty line (several allow a rotation).

    Raises ConfigError naming `key` if the file cannot be read or holds no key.
    """
    if path is None:
        return ()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc}") from None
    keys = tuple(line.strip().encode() for line in text.splitlines() if line.strip())
    if not keys:
        raise ConfigError(f"{key}: {path} holds no key")
    return keys


@dataclass(frozen=True)
class TenantDirectory:
    """Every key the node knows and the tenant it belongs to, and each tenant's settings.

    `keys` pairs a key with its tenant's name; a key in two places is the first one's (a
    `[[tenants]]` entry before `api_key_file`)."""

    keys: tuple[tuple[bytes, str], ...] = ()
    tenants: tuple[TenantConfig, ...] = ()

    @classmethod
    def from_config(cls, config: NeuronConfig) -> TenantDirectory:
        """Read every tenant's keys file and `server.api_key_file`. Raises ConfigError naming
        the key if a file cannot be read, holds no key, or two key tenants' names collide."""
        keys: list[tuple[bytes, str]] = []
        tenants = list(config.tenants)
        for i, tenant in enumerate(config.tenants):
            for token in read_api_keys(tenant.keys_file, f"tenants[{i}].keys_file"):
                keys.append((token, tenant.name))
        named = {token for token, _ in keys}
        for token in read_api_keys(config.server.api_key_file):
            if token in named:
                continue
            name = key_tenant_name(token)
            if any(t.name == name for t in tenants):
                raise ConfigError(f"server.api_key_file: two keys share the name {name}")
            keys.append((token, name))
            tenants.append(TenantConfig(name=name))
            named.add(token)
        if config.server.admin_key_file is not None:
            tenants.append(TenantConfig(name=OPERATOR_TENANT))  # an admin key's own requests
        return cls(keys=tuple(keys), tenants=tuple(tenants))

    @property
    def api_keys(self) -> tuple[bytes, ...]:
        return tuple(token for token, _ in self.keys)

    @property
    def names(self) -> tuple[str, ...]:
        """The configured tenants' names (metrics label these; any other is folded)."""
        return tuple(t.name for t in self.tenants)

    def lookup(self, token: bytes) -> str | None:
        """The tenant of `token`, or None. Compares against every key (no early exit), each
        in constant time, as the middleware's own check does."""
        found: str | None = None
        for key, name in self.keys:
            if hmac.compare_digest(token, key) and found is None:
                found = name
        return found

    def get(self, name: str | None) -> TenantConfig | None:
        return next((t for t in self.tenants if t.name == name), None)

    def cache_identity(self, name: str | None) -> bytes | None:
        """What a tenant's prefix-cache salt is made of: its group's name when it shares one,
        else its own; tagged, so a group and a tenant of the same name never meet."""
        if name is None:
            return None
        tenant = self.get(name)
        if tenant is not None and tenant.prefix_cache_group is not None:
            return b"group:" + tenant.prefix_cache_group.encode()
        return b"tenant:" + name.encode()


def is_operator(scope: Scope) -> bool:
    """True unless the middleware said the caller is not an operator (unit tests: True)."""
    return scope.get(OPERATOR_SCOPE_KEY, True) is not False


def job_cache_salt(tenant: bytes | None, salt: bytes | None) -> bytes | None:
    """The salt of a job: the tenant's and the client's, length-prefixed so that no pair can
    be mistaken for another. None when neither is set (the shared cache)."""
    if tenant is None and salt is None:
        return None
    parts = []
    for tag, value in ((b"t", tenant), (b"s", salt)):
        if value is not None:
            parts.append(tag + len(value).to_bytes(4, "big") + value)
    return b"".join(parts)


def _looks_like_path(source: Any) -> bool:
    return isinstance(source, str) and not source.startswith(("builtin:", "hf:"))


def redact_node_info(doc: dict[str, Any]) -> dict[str, Any]:
    """`/v1/node` for a caller that is not an operator: no file paths, no forensics, no
    prefix-cache counters (a tenant could read another's hits from them)."""
    out = dict(doc)
    if "config" in out:
        out["config"] = HIDDEN
    if out.get("last_forensics") is not None:
        out["last_forensics"] = HIDDEN
    models = []
    for model in out.get("models") or []:
        model = dict(model)
        for key in ("path", "last_error"):  # a load error may name the file's path
            if model.get(key) is not None:
                model[key] = HIDDEN
        if _looks_like_path(model.get("source")):
            model["source"] = HIDDEN
        kv = model.get("kv_cache")
        if isinstance(kv, dict):
            kv = dict(kv)
            for key in ("prefix_cache_queries_tokens", "prefix_cache_hits_tokens"):
                if key in kv:
                    kv[key] = None
            model["kv_cache"] = kv
        models.append(model)
    if "models" in out:
        out["models"] = models
    return out
