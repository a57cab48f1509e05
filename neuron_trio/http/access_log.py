"""One log line per request an operator may want to find again (logger `neuron_trio.access`).

`/health` and `/metrics` are left out (routers and scrapers poll them every few seconds)
unless they fail with a 5xx other than health's own 503. The middleware puts an `AccessInfo`
into the ASGI scope; the generation handlers fill in the model, token counts, finish reason
and first-token time; the middleware writes the line when the response has ended:

    POST /v1/chat/completions 200 0.412s h2 127.0.0.1 tenant=team-a model=smollm2-135m prompt=34 completion=12 finish=stop ttft=0.061s
    POST /v1/completions 400 0.002s h2 127.0.0.1 error="max_tokens: Expected `int` >= 1"

Set NEURON_LOG_LEVEL=WARNING to drop them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from starlette.types import Scope

from neuron_trio.http.tenancy import tenant_name_of

__all__ = ["ACCESS_SCOPE_KEY", "AccessInfo", "access_info", "log_access"]

log = logging.getLogger("neuron_trio.access")

ACCESS_SCOPE_KEY = "neuron.access"
QUIET_ROUTES = frozenset({"/health", "/metrics"})
MAX_ERROR_CHARS = 300
# Every client-controlled field is cut to this many characters, with control characters
# replaced: a 900 KB `model` value wrote a 900 KB log line (issue 25, #10), and a newline in
# a path could forge a second line.
MAX_FIELD_CHARS = 200
_CONTROL = {c: "?" for c in [*range(0x20), 0x7F]}


def bounded(value: object, limit: int = MAX_FIELD_CHARS) -> str:
    """`value` as one short line: control characters as "?", cut at `limit` with a count."""
    text = str(value)
    if len(text) > limit:
        text = f"{text[:limit]}…(+{len(text) - limit} chars)"
    return text.translate(_CONTROL)


@dataclass
class AccessInfo:
    """What the handlers learnt about one request, for its access line."""

    started: float  # time.perf_counter() when the middleware saw the request
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    first_token_at: float | None = None  # perf_counter() when the first token was sent
    error: str | None = None  # the message of a JSON error response


def access_info(scope: Scope) -> AccessInfo | None:
    """The scope's AccessInfo (None when no middleware put one there, as in unit tests)."""
    info = scope.get(ACCESS_SCOPE_KEY)
    return info if isinstance(info, AccessInfo) else None


def log_access(scope: Scope, route: str, status: int, ended: float, info: AccessInfo) -> None:
    if route in QUIET_ROUTES and (status < 500 or status == 503):
        return
    if not log.isEnabledFor(logging.INFO):
        return
    client = scope.get("client")
    parts = [
        bounded(scope.get("method", ""), 16),
        bounded(scope.get("path", "")),
        str(status),
        f"{ended - info.started:.3f}s",
        "h2" if scope.get("http_version") == "2" else f"http/{scope.get('http_version', '?')}",
        str(client[0]) if client else "-",
    ]
    tenant = tenant_name_of(scope)  # the tenant's name, never its key (issue 47)
    if tenant is not None:
        parts.append(f"tenant={tenant}")
    if info.model is not None:
        parts.append(f"model={bounded(info.model)}")
    if info.prompt_tokens is not None:
        parts.append(f"prompt={info.prompt_tokens}")
    if info.completion_tokens is not None:
        parts.append(f"completion={info.completion_tokens}")
    if info.finish_reason is not None:
        parts.append(f"finish={info.finish_reason}")
    if info.first_token_at is not None:
        parts.append(f"ttft={info.first_token_at - info.started:.3f}s")
    if info.error is not None:
        parts.append(f'error="{bounded(info.error.replace(chr(34), chr(39)), MAX_ERROR_CHARS)}"')
    log.info("%s", " ".join(parts))
