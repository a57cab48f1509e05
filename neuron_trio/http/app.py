"""The ASGI app: routes over a `NodeService`, JSON errors, auth, limits, metrics.

`create_app(node, config)` is all the daemon needs; the app talks to nothing but `node`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Scope

from neuron_trio.config import ModelConfig, NeuronConfig
from neuron_trio.errors import (
    ApiError,
    ConfigError,
    ModelFileError,
    ModelLoadError,
    ModelNotFoundError,
    PlacementError,
    QueueFullError,
    RequestError,
    SourceError,
    UnavailableError,
    UnsupportedModelError,
)
from neuron_trio.http.access_log import access_info
from neuron_trio.http.batch_generation import BatchSSEResponse, complete_batch
from neuron_trio.http.cors import with_cors
from neuron_trio.http.generation import ClientGone, SSEResponse, complete
from neuron_trio.http.metrics import http_metrics
from neuron_trio.http.middleware import NeuronMiddleware
from neuron_trio.http.openai import (
    ParsedRequest,
    decode_struct,
    error_body,
    parse_chat_request,
)
from neuron_trio.http.openai.completion_batch import CompletionBatch, parse_completion_batch
from neuron_trio.http.openai.models_api import model_object
from neuron_trio.http.orca import OrcaLoadReports
from neuron_trio.http.responses_endpoint import ResponsesEndpoint
from neuron_trio.http.tenancy import (
    TenantDirectory,
    is_operator,
    job_cache_salt,
    read_api_keys,
    redact_node_info,
    tenant_name_of,
)
from neuron_trio.http.tokenize_endpoints import TokenizeEndpoints
from neuron_trio.service.api import GenerationJob, NodeService

__all__ = ["JSONResponse", "create_app", "read_api_keys"]

log = logging.getLogger(__name__)

UNMATCHED_ROUTE = "<unmatched>"

P = TypeVar("P")
Handler = Callable[[Request], Awaitable[Response]]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, set | frozenset):
        return sorted(obj, key=str)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} as JSON")


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _encoder.encode(content)


def _error_response(
    status: int,
    message: str,
    *,
    error_type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = error_body(message, error_type=error_type, code=code, param=param)
    return JSONResponse(body, status_code=status, headers=headers)


# --- exception handlers --------------------------------------------------------------------


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    headers = None
    if isinstance(exc, QueueFullError | UnavailableError):
        headers = {"Retry-After": str(max(1, int(exc.retry_after_s)))}
    return _error_response(
        exc.status,
        exc.message,
        error_type=exc.error_type,
        code=exc.code,
        param=exc.param,
        headers=headers,
    )


async def _on_load_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ModelLoadError)
    if isinstance(exc, SourceError):
        return _error_response(400, str(exc), code="invalid_source", param="source")
    if isinstance(exc, PlacementError):
        return _error_response(507, str(exc), error_type="server_error", code="insufficient_memory")
    if isinstance(exc, UnsupportedModelError):  # a well-formed file neuron cannot run
        return _error_response(422, str(exc), code="unsupported_model", param="source")
    if isinstance(exc, ModelFileError):
        return _error_response(422, str(exc), code="invalid_model_file", param="source")
    return _error_response(500, str(exc), error_type="server_error", code="model_load_failed")


async def _on_config_error(request: Request, exc: Exception) -> Response:
    # A model entry that cannot work as given (e.g. a tp that does not divide the heads).
    return _error_response(400, str(exc), code="invalid_model_config")


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _error_response(
            404,
            f"no route for {request.method} {request.url.path}",
            error_type="not_found_error",
            code="not_found",
        )
    if exc.status_code == 405:
        return _error_response(
            405,
            f"method {request.method} is not allowed on {request.url.path}",
            code="method_not_allowed",
            headers=dict(exc.headers or {}),
        )
    return _error_response(
        exc.status_code, str(exc.detail), code=None, headers=dict(exc.headers or {})
    )


async def _on_decode_error(request: Request, exc: Exception) -> Response:
    return _error_response(400, f"request body is not valid JSON: {exc}", code="invalid_json")


async def _on_client_disconnect(request: Request, exc: Exception) -> Response:
    # The client reset its stream (or closed) before its body arrived: nothing to answer,
    # nothing to log; the access line says 499.
    return ClientGone()


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # Logged by NeuronMiddleware (Starlette re-raises after answering); never a traceback here.
    return _error_response(500, "internal error", error_type="server_error", code="internal_error")


# --- routes ------------------------------------------------------------------------------

# Bodies larger than this are decoded and validated on a worker thread: 34,000 empty chat
# messages (1 MB) took ~100 ms of the event loop to become structs, and /health waited.
INLINE_PARSE_BYTES = 64 << 10


async def _off_loop_if_large(parse: Callable[[bytes], P], body: bytes) -> P:
    if len(body) <= INLINE_PARSE_BYTES:
        return parse(body)
    return await trio.to_thread.run_sync(parse, body)


class _Routes:
    def __init__(
        self,
        node: NodeService,
        *,
        max_messages: int,
        tenants: TenantDirectory,
        isolate_tenants: bool = True,
    ) -> None:
        self.node = node
        self.max_messages = max_messages
        self.tenants = tenants
        self.isolate_tenants = isolate_tenants
        self._metrics_limiter: trio.CapacityLimiter | None = None
        self.responses = ResponsesEndpoint(node, admit=self.admit)
        self.tokens = TokenizeEndpoints(node, max_messages=max_messages)

    def admit(self, request: Request, job: GenerationJob) -> GenerationJob:
        """`job` checked and salted as every generating route needs: at most
        `server.max_messages` messages, its tenant's name and its prefix-cache salt (the
        client's `cache_salt` and, unless `prefix_cache_isolation = "none"`, the tenant's or
        its group's name: http/tenancy.py), which also scopes its constraint's compiled
        grammar (`Constraint.scope`: no grammar-cache hit across tenants).
        Chat, completions and the Responses API pass their jobs through here."""
        count = len(job.messages or ())
        if count > self.max_messages:
            raise RequestError(
                f"messages: {count} messages; at most {self.max_messages} "
                "(server.max_messages) in one request",
                param="messages",
                code="too_many_messages",
            )
        name = tenant_name_of(request.scope)
        tenant = self.tenants.cache_identity(name) if self.isolate_tenants else None
        salt = job_cache_salt(tenant, job.cache_salt)
        constraint = job.params.constraint
        # grammars shared per salt, charged to the tenant's share of the grammar cache
        if constraint is not None and (constraint.scope, constraint.owner) != (salt, name):
            constraint = replace(constraint, scope=salt, owner=name)
            job = replace(job, params=replace(job.params, constraint=constraint))
        if salt == job.cache_salt and name == job.tenant:
            return job
        return replace(job, cache_salt=salt, tenant=name)

    def unless_draining(self, handler: Handler) -> Handler:
        """`handler` for a route that starts new work (a generation, a model load): while the
        node drains it is refused (503) here, before its body is read or parsed. The route
        table is the one place the HTTP layer checks; the node checks again for itself
        (`Node.generate`), for a drain that began while the body was parsed."""

        async def refused_while_draining(request: Request) -> Response:
            if self.node.draining:
                raise UnavailableError("the node is draining; try another node", code="draining")
            return await handler(request)

        return refused_while_draining

    async def health(self, request: Request) -> Response:
        snap = self.node.health()
        body = {
            **snap.detail,
            "status": snap.status,
            "boot_id": snap.boot_id,
            "started_at": snap.started_at,
            "starts": snap.starts,
        }
        return JSONResponse(
            body,
            status_code=200 if snap.status == "ok" else 503,
            headers={"Cache-Control": "no-store"},
        )

    async def node_info(self, request: Request) -> Response:
        doc = await self.node.node_info()
        return JSONResponse(doc if is_operator(request.scope) else redact_node_info(doc))

    async def metrics(self, request: Request) -> Response:
        # Built on a worker thread, one scrape at a time: the exposition of a few thousand
        # series takes milliseconds to seconds of CPU that /health must not wait behind.
        if self._metrics_limiter is None:
            self._metrics_limiter = trio.CapacityLimiter(1)
        text = await trio.to_thread.run_sync(
            generate_latest, self.node.metrics_registry, limiter=self._metrics_limiter
        )
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        if request.method == "POST":
            return await self.unless_draining(self.load_model)(request)
        return await self.list_models(request)

    async def list_models(self, request: Request) -> Response:
        data = [model_object(m) for m in self.node.list_models()]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{name}` (the openai client's `models.retrieve`), or the unload."""
        if request.method == "DELETE":
            return await self.unload_model(request)
        name = request.path_params["name"]
        found = next((m for m in self.node.list_models() if m.name == name), None)
        if found is None:
            raise ModelNotFoundError(name)
        return JSONResponse(model_object(found))

    def _fingerprint(self, model: str) -> str | None:
        found = next((m for m in self.node.list_models() if m.name == model), None)
        return found.fingerprint or None if found is not None else None

    async def load_model(self, request: Request) -> Response:
        spec = decode_struct(await request.body(), ModelConfig)
        info = await self.node.load_model(spec)
        return JSONResponse(info, status_code=201)

    async def unload_model(self, request: Request) -> Response:
        name = request.path_params["name"]
        await self.node.unload_model(name)
        return JSONResponse({"id": name, "object": "model", "deleted": True})

    async def chat_completions(self, request: Request) -> Response:
        parsed = await _off_loop_if_large(parse_chat_request, await request.body())
        return await self._generate(request, parsed)

    async def completions(self, request: Request) -> Response:
        batch = await _off_loop_if_large(parse_completion_batch, await request.body())
        if len(batch.parts) > 1 or batch.echo is not None:
            return await self._generate_batch(request, batch)
        return await self._generate(request, batch.first)

    async def _generate_batch(self, request: Request, batch: CompletionBatch) -> Response:
        access = access_info(request.scope)
        if access is not None:
            access.model = batch.first.job.model
        batch = batch.with_fingerprint(self._fingerprint(batch.first.job.model))
        batch = replace(
            batch, parts=tuple(replace(p, job=self.admit(request, p.job)) for p in batch.parts)
        )
        if batch.first.stream:
            return BatchSSEResponse(self.node, batch)
        doc = await complete_batch(self.node, batch, request.receive, access)
        return ClientGone() if doc is None else JSONResponse(doc)

    async def _generate(self, request: Request, parsed: ParsedRequest) -> Response:
        access = access_info(request.scope)
        if access is not None:
            access.model = parsed.job.model
        parsed = replace(
            parsed,
            job=self.admit(request, parsed.job),
            system_fingerprint=self._fingerprint(parsed.job.model),
        )
        if parsed.stream:
            return SSEResponse(self.node, parsed)
        doc = await complete(self.node, parsed, request.receive, access)
        if doc is None:
            return ClientGone()
        return JSONResponse(doc)


def _route_resolver(routes: list[Route]) -> Any:
    def route_of(scope: Scope) -> str:
        partial = None
        for route in routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route.path
            if match is Match.PARTIAL and partial is None:
                partial = route.path
        return partial or UNMATCHED_ROUTE

    return route_of


def create_app(node: NodeService, config: NeuronConfig) -> ASGIApp:
    """The ASGI app serving `node`. Raises ConfigError if `api_key_file` is unusable."""
    tenants = TenantDirectory.from_config(config)
    r = _Routes(
        node,
        max_messages=config.server.max_messages,
        tenants=tenants,
        isolate_tenants=config.server.prefix_cache_isolation != "none",
    )
    work = r.unless_draining  # routes that start new work
    routes = [
        Route("/health", r.health, methods=["GET"]),
        Route("/metrics", r.metrics, methods=["GET"]),
        Route("/v1/node", r.node_info, methods=["GET"]),
        Route("/v1/models", r.models, methods=["GET", "POST"]),
        Route("/v1/models/{name}", r.model, methods=["GET", "DELETE"]),
        Route("/v1/chat/completions", work(r.chat_completions), methods=["POST"]),
        Route("/v1/completions", work(r.completions), methods=["POST"]),
        Route("/v1/responses", work(r.responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", r.responses.retrieve, methods=["GET", "DELETE"]),
        # llama.cpp's and vLLM's paths, outside /v1 (keyed as /v1 is: middleware.py)
        Route("/tokenize", r.tokens.tokenize, methods=["POST"]),
        Route("/detokenize", r.tokens.detokenize, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            HTTPException: _on_http_exception,
            ClientDisconnect: _on_client_disconnect,
            ApiError: _on_api_error,
            ModelLoadError: _on_load_error,
            ConfigError: _on_config_error,
            msgspec.DecodeError: _on_decode_error,
            Exception: _on_unexpected,
        },
    )
    guarded = NeuronMiddleware(
        OrcaLoadReports(app, node.load),
        metrics=http_metrics(node.metrics_registry),
        route_of=_route_resolver(routes),
        api_keys=tenants.api_keys,
        tenants=tenants,
        admin_keys=read_api_keys(config.server.admin_key_file, "server.admin_key_file"),
        metrics_keys=read_api_keys(config.server.metrics_key_file, "server.metrics_key_file"),
        max_body_bytes=config.server.max_body_bytes,
        read_timeout_s=config.server.read_timeout_s,
    )
    # Outermost: a CORS preflight is answered before auth (a browser sends no key with it).
    return with_cors(guarded, config.server.cors_allow_origins)
