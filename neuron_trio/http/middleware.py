"""The outermost ASGI layer: metrics, auth, the body limit, last-resort errors, shielded end.

Order, outside in (one class, so each request pays for one wrapper, not five):
1. metrics: in-flight gauge, count and latency by route template and status; the access log
   line (http/access_log.py) once the response has ended;
2. last resort: an exception that escapes the app is logged once and, if no response has
   started, answered with a generic JSON 500 (never a traceback);
3. shielded final send: the last `http.response.body` of a response is sent inside a shielded
   (and bounded) cancel scope; without it hypercorn never restarts a connection's idle timer
   after a streaming response and a drain waits its whole graceful timeout (docs/STACK-NOTES.md);
4. auth: with API keys, every `/v1/*` route needs `Authorization: Bearer <key>`; with admin
   keys, loading and unloading models needs one of those (another valid key: 403); with API
   keys or metrics keys, `/metrics` needs an operator's key (`_metrics_keys`); the request's
   tenant (its name) and whether it is an operator go into the scope;
   an admin key may name the tenant it acts for in X-Neuron-Tenant (tenancy.py);
5. body limit: a `Content-Length` over the limit is a 413 at once; otherwise `receive()`
   counts bytes as they arrive (chunked bodies too) and raises BodyTooLargeError past it;
   each wait for the next piece of body is bounded by `read_timeout_s` (408).

An HTTP/2 response that did not read its whole request body (401, 413, 404, …) reads and
drops some more of it before its last frame goes out (body_discard.py: the policy and its
bounds, and the phase after the response, in _hypercorn_fixes.py).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import trio
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuron_trio.config import OPERATOR_TENANT
from neuron_trio.errors import RequestError
from neuron_trio.http.access_log import ACCESS_SCOPE_KEY, AccessInfo, log_access
from neuron_trio.http.metrics import HttpMetrics
from neuron_trio.http.openai import error_body
from neuron_trio.http.tenancy import (
    OPERATOR_SCOPE_KEY,
    TENANT_HEADER,
    TENANT_NAME_SCOPE_KEY,
    TenantDirectory,
    key_tenant_name,
)
from neuron_trio.http.wire import body_discard

__all__ = ["BodyTooLargeError", "NeuronMiddleware", "json_error_messages"]

log = logging.getLogger(__name__)

FINAL_SEND_TIMEOUT_S = 10.0
CLIENT_CLOSED_STATUS = 499  # nginx's convention: the client left before its response
ADMIN_ROUTES = ("/v1/models",)  # POST it, DELETE below it
KEYED_ROOT_ROUTES = ("/tokenize", "/detokenize")  # llama.cpp's and vLLM's, keyed as /v1/* is


class RequestTimeoutError(RequestError):
    """Raised by the limited `receive()` if the next piece of a request body is too late."""

    status = 408

    def __init__(self, seconds: float):
        super().__init__(
            f"the request body did not arrive within {seconds:g} s", code="request_timeout"
        )


class BodyTooLargeError(RequestError):
    """Raised by the limited `receive()` if a request body grows past `max_body_bytes`."""

    status = 413

    def __init__(self, limit: int):
        super().__init__(f"request body is larger than {limit} bytes", code="request_too_large")


def json_error_messages(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[Message]:
    raw = msgspec.json.encode(body)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return [
        {"type": "http.response.start", "status": status, "headers": head},
        {"type": "http.response.body", "body": raw, "more_body": False},
    ]


def _error_message(body: bytes) -> str | None:
    """The `error.message` of a JSON error body, if that is what `body` is."""
    try:
        doc = msgspec.json.decode(body)
        message = doc["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return None
    return message if isinstance(message, str) else None


def _is_client_disconnect(exc: BaseException) -> bool:
    """`exc` is Starlette's ClientDisconnect, or a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_client_disconnect(e) for e in exc.exceptions)
    return isinstance(exc, ClientDisconnect)


@dataclass(frozen=True)
class Denied:
    """Why the middleware answers a request itself, before the app sees it."""

    status: int
    message: str
    error_type: str
    code: str
    headers: dict[str, str] | None = None


UNAUTHENTICATED = Denied(
    401,
    "missing or invalid API key (Authorization: Bearer <key>)",
    "authentication_error",
    "invalid_api_key",
    {"WWW-Authenticate": "Bearer"},
)
NOT_ADMIN = Denied(
    403,
    "loading and unloading models needs the admin key",
    "permission_error",
    "admin_key_required",
)
NOT_A_ROUTER = Denied(
    403,
    f"{TENANT_HEADER}: only an admin key may act for a tenant",
    "permission_error",
    "tenant_header_forbidden",
)


def _unknown_tenant(raw: bytes) -> Denied:
    shown = raw[:64].decode("ascii", "replace")  # bounded: it goes into the body and the log
    return Denied(
        400,
        f"{TENANT_HEADER}: no tenant named {shown!r} is configured",
        "invalid_request_error",
        "unknown_tenant",
    )


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


class _Body:
    """The request body as the app reads it: counted against `limit` (BodyTooLargeError past
    it, chunked bodies too), each wait for the next piece bounded by `read_timeout_s` (408)."""

    def __init__(self, receive: Receive, limit: int, read_timeout_s: float) -> None:
        self._receive = receive
        self.limit = limit
        self.read_timeout_s = read_timeout_s
        self.received = 0
        self.done = False  # the last piece arrived (or the client left)
        self.client_gone = False

    async def receive(self) -> Message:
        if self.done:
            message = await self._receive()
        else:
            with trio.move_on_after(self.read_timeout_s) as waited:
                message = await self._receive()
            if waited.cancelled_caught:
                raise RequestTimeoutError(self.read_timeout_s)
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.done = not message.get("more_body", False)
            if self.received > self.limit:
                raise BodyTooLargeError(self.limit)
        elif message["type"] == "http.disconnect":
            self.done = self.client_gone = True
        return message

    async def discard_rest(self) -> None:
        """body_discard.py's first phase: an unread body must not fill hypercorn's queue for
        the app, which would block the connection's reader and this stream's close."""
        dropped = 0
        with trio.move_on_after(body_discard.BEFORE_END_TIMEOUT_S):
            while not self.done and dropped <= body_discard.BEFORE_END_BYTES:
                message = await self._receive()
                dropped += len(message.get("body", b""))
                self.done = message["type"] == "http.disconnect" or not message.get(
                    "more_body", False
                )


class _Response:
    """What the app sends: its status, an error's message for the access log, and its last
    frame (over HTTP/2 after the rest of the body; shielded, at most FINAL_SEND_TIMEOUT_S)."""

    def __init__(self, send: Send, body: _Body, access: AccessInfo, *, http2: bool) -> None:
        self._send = send
        self._body = body
        self._access = access
        self._http2 = http2
        self.status: int | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            if self.status is not None and self.status >= 400 and self._access.error is None:
                self._access.error = _error_message(message.get("body", b""))
            if self._http2:
                await self._body.discard_rest()
            with trio.move_on_after(FINAL_SEND_TIMEOUT_S) as scope:
                scope.shield = True
                await self._send(message)
            return
        await self._send(message)


class NeuronMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: HttpMetrics,
        route_of: Callable[[Scope], str],
        api_keys: tuple[bytes, ...] = (),
        admin_keys: tuple[bytes, ...] = (),
        metrics_keys: tuple[bytes, ...] = (),
        tenants: TenantDirectory | None = None,
        max_body_bytes: int,
        read_timeout_s: float = 30.0,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.route_of = route_of
        if tenants is None:  # one tenant per key, as `api_key_file` alone gives
            tenants = TenantDirectory(keys=tuple((k, key_tenant_name(k)) for k in api_keys))
        self.tenants = tenants
        self.api_keys = api_keys or tenants.api_keys
        self.admin_keys = admin_keys
        self.metrics_keys = metrics_keys
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    @staticmethod
    def _matches(token: bytes, keys: tuple[bytes, ...]) -> bool:
        # Compare against every key (no early exit), each in constant time.
        ok = False
        for key in keys:
            ok |= hmac.compare_digest(token, key)
        return ok

    def _metrics_keys(self) -> tuple[bytes, ...]:
        """Who may read /metrics (its prefix-cache counters tell one tenant of another's hits):
        the metrics keys and admin keys; with neither, any API key; with no key file at all,
        anyone (an empty tuple)."""
        if self.metrics_keys or self.admin_keys:
            return self.metrics_keys + self.admin_keys if self.api_keys or self.metrics_keys else ()
        return self.api_keys

    def _bearer(self, scope: Scope) -> bytes:
        header = _header(scope, b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        return token.strip() if scheme.lower() == b"bearer" else b""

    def _auth_status(self, scope: Scope) -> Denied | None:
        """None if the request may go on; else why not: 401 (no valid key), 403 (not an admin
        key, or a tenant header from a key that may not send it), 400 (an unknown tenant).
        Marks the scope with the caller's tenant and whether it is an operator."""
        path: str = scope["path"]
        if path == "/metrics":
            keys = self._metrics_keys()
            if not keys:
                return None
            token = self._bearer(scope)
            return None if token and self._matches(token, keys) else UNAUTHENTICATED
        if path != "/v1" and not path.startswith("/v1/") and path not in KEYED_ROOT_ROUTES:
            return None
        admin_route = self.admin_keys and (
            (scope["method"] == "POST" and path in ADMIN_ROUTES)
            or (scope["method"] == "DELETE" and path.startswith(ADMIN_ROUTES[0] + "/"))
        )
        if not self.api_keys and not admin_route:
            # No keys: everyone is an operator (the scope says nothing), and may name a tenant.
            return self._name_tenant(scope, None, may_act_for_others=True)
        token = self._bearer(scope)
        is_admin = bool(token) and self._matches(token, self.admin_keys)
        is_user = bool(token) and (is_admin or self._matches(token, self.api_keys))
        scope[OPERATOR_SCOPE_KEY] = is_admin or (is_user and not self.admin_keys)
        if admin_route:
            if is_admin:
                return None
            return NOT_ADMIN if is_user else UNAUTHENTICATED
        if not is_user:
            return UNAUTHENTICATED
        own = self.tenants.lookup(token) or (OPERATOR_TENANT if is_admin else None)
        return self._name_tenant(scope, own, may_act_for_others=is_admin)

    def _name_tenant(
        self, scope: Scope, own: str | None, *, may_act_for_others: bool
    ) -> Denied | None:
        """Put the request's tenant in the scope: the one named in X-Neuron-Tenant if the
        caller may act for others (an admin key, or anyone without keys), else its own."""
        if own is not None:
            scope[TENANT_NAME_SCOPE_KEY] = own  # a refusal below is logged under it too
        named = _header(scope, TENANT_HEADER.lower().encode())
        if named is None:
            return None
        if not may_act_for_others:
            return NOT_A_ROUTER
        name = named.decode("ascii", "replace").strip()
        if name not in self.tenants.names:
            return _unknown_tenant(named)
        scope[TENANT_NAME_SCOPE_KEY] = name
        return None

    def _content_length(self, scope: Scope) -> int | None:
        raw = _header(scope, b"content-length")
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.route_of(scope)
        body = _Body(receive, self.max_body_bytes, self.read_timeout_s)
        access = AccessInfo(started=time.perf_counter())
        response = _Response(send, body, access, http2=scope.get("http_version") == "2")
        scope[ACCESS_SCOPE_KEY] = access
        self.metrics.in_flight.inc()
        try:
            if not await self._refused(scope, response.send):
                await self.app(scope, body.receive, response.send)
        except Exception as exc:
            await self._failed(scope, exc, body, response)
        finally:
            ended = time.perf_counter()
            status = response.status if response.status is not None else CLIENT_CLOSED_STATUS
            self.metrics.in_flight.dec()
            self.metrics.observe(route, scope.get("method", ""), status, ended - access.started)
            log_access(scope, route, status, ended, access)

    async def _refused(self, scope: Scope, send: Send) -> bool:
        """Answer, and say True, a request refused before the app sees it: no valid key, or
        a body whose Content-Length is over the limit (413 at once)."""
        denied = self._auth_status(scope)
        if denied is not None:
            body = error_body(denied.message, error_type=denied.error_type, code=denied.code)
            await self._reply(send, denied.status, body, denied.headers)
            return True
        limit = self.max_body_bytes
        if (self._content_length(scope) or 0) <= limit:
            return False
        message = f"request body is larger than {limit} bytes"
        close = {"Connection": "close"} if scope.get("http_version") == "1.1" else None
        await self._reply(send, 413, error_body(message, code="request_too_large"), close)
        return True

    async def _failed(self, scope: Scope, exc: Exception, body: _Body, response: _Response) -> None:
        """What the app raised: a client that left is no server error (499); anything else is
        logged with its traceback and, if no response has started, answered with a 500."""
        if body.client_gone or _is_client_disconnect(exc):
            # The client reset its stream or closed: not a server error, whatever the app
            # raised on the way out (a ClientDisconnect inside a task group's exception group
            # missed its handler and was counted as a 5xx; issue 25, #11).
            if response.status is None or response.status >= 500:
                response.status = None
            return
        log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
        if response.status is None:
            internal = error_body(
                "internal error", error_type="server_error", code="internal_error"
            )
            await self._reply(response.send, 500, internal)

    @staticmethod
    async def _reply(
        send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        for message in json_error_messages(status, body, headers):
            await send(message)
