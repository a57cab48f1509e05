"""Who is asking: tenants (API keys) kept apart in the prefix cache, operators told more.

Issue 25 (#6, #10). A shared prefix cache is a timing oracle: a client guessing another's
system prompt saw its first token in 0.029 s on a right guess against 0.75-0.91 s on wrong
ones, and `/metrics` (open) showed the hit tokens exactly. So:

- `cache_salt` (a request field, as in vLLM) and, with `server.prefix_cache_isolation =
  "api_key"`, the digest of the caller's key are folded into the job's salt
  (`job_cache_salt`): cached prompt blocks are shared only between requests with the same
  salt (engine/block_pool.py). The tenant part comes from authentication, so no `cache_salt`
  a client may send can equal another tenant's salt.
- The middleware marks each request with its tenant (the key's digest) and whether its key
  is an operator's: the admin key when `admin_key_file` is set, else any key (or no key
  configured at all). `/v1/node` shows file paths, the last forensics report and the prefix
  cache's hit counters to operators only (`redact_node_info`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from starlette.types import Scope

__all__ = [
    "OPERATOR_SCOPE_KEY",
    "TENANT_SCOPE_KEY",
    "is_operator",
    "job_cache_salt",
    "key_digest",
    "redact_node_info",
    "tenant_of",
]

TENANT_SCOPE_KEY = "neuron.tenant"
OPERATOR_SCOPE_KEY = "neuron.operator"
HIDDEN = "<hidden: needs the admin key>"


def key_digest(token: bytes) -> bytes:
    """A tenant's identity: a digest of its API key (the key itself is never kept)."""
    return hashlib.blake2b(token, digest_size=16, person=b"neuron-tenant").digest()


def tenant_of(scope: Scope) -> bytes | None:
    value = scope.get(TENANT_SCOPE_KEY)
    return value if isinstance(value, bytes) else None


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
