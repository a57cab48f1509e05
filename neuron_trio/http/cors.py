"""CORS for browser clients: `server.cors_allow_origins` (off when empty, the default).

Starlette's `CORSMiddleware` does the work, wrapped around everything else (`create_app`), so:

- a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is answered here,
  before auth: a browser never sends the API key with one. An allowed origin gets
  `Access-Control-Allow-Origin` (the origin itself, or `*` when the list holds `*`),
  `-Allow-Methods`, `-Allow-Headers` (the headers it asked for: the openai SDK sends its own
  `x-stainless-*` ones) and `-Max-Age`; any other origin gets a 400 in the usual error shape.
  Preflights are thus not in the HTTP metrics or the access log;
- every other response (401, 404 and 429 included, so a page can read why it failed) carries
  `Access-Control-Allow-Origin` and `Vary: Origin` for an allowed origin only, and
  `Access-Control-Expose-Headers: Retry-After` so that a page can honour a 429 or 503.

No credentials mode: neuron's keys are bearer tokens a page sends itself, never cookies.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp

from neuron_trio.http.openai import error_body

__all__ = ["ALLOW_METHODS", "MAX_AGE_S", "with_cors"]

ALLOW_METHODS = ("GET", "POST", "DELETE", "OPTIONS")
MAX_AGE_S = 600  # seconds a browser may reuse a preflight's answer
EXPOSE_HEADERS = ("Retry-After",)


class _Cors(CORSMiddleware):
    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        # Starlette says "Disallowed CORS origin" as plain text; neuron's errors are JSON.
        message = bytes(response.body).decode("utf-8", "replace")
        body = error_body(f"CORS preflight refused: {message}", code="cors_not_allowed")
        headers = {k: v for k, v in response.headers.items() if k.startswith("access-control")}
        headers["vary"] = response.headers.get("vary", "Origin")
        return Response(
            msgspec.json.encode(body), 400, headers=headers, media_type="application/json"
        )


def with_cors(app: ASGIApp, allow_origins: Sequence[str]) -> ASGIApp:
    """`app` answering CORS for `allow_origins` (exact `scheme://host[:port]` strings, or
    `*`); `app` itself when the list is empty."""
    if not allow_origins:
        return app
    return _Cors(
        app,
        allow_origins=tuple(allow_origins),
        allow_methods=ALLOW_METHODS,
        allow_headers=("*",),
        expose_headers=EXPOSE_HEADERS,
        max_age=MAX_AGE_S,
    )
