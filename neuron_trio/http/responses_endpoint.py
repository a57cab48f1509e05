"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: the Responses API over the
node, as a JSON body or as server-sent events.

The request becomes a chat job (`openai.responses_api`); it runs as `generation` runs chat
completions (one task owns the `generate` context, `receive()` is watched for a disconnect).
A response that finished is stored (unless `store: false`) in a bounded `ResponseStore`, on
its tenant's shelf: another tenant's key finds nothing there (404).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Send

from neuron_trio.errors import ApiError
from neuron_trio.http.access_log import AccessInfo, access_info
from neuron_trio.http.generation import (
    ClientGone,
    StreamedResponse,
    _body,
    finish_error,
    started_events,
    transcribe,
)
from neuron_trio.http.openai.responses import Transcript, now
from neuron_trio.http.openai.responses_api import (
    ParsedResponsesRequest,
    history_of,
    new_item_id,
    output_items,
    parse_responses_request,
    response_object,
    responses_usage,
)
from neuron_trio.http.openai.responses_stream import ResponsesStreamWriter
from neuron_trio.http.response_store import ResponseStore
from neuron_trio.http.tenancy import tenant_name_of
from neuron_trio.service.api import GenerationJob, NodeService

__all__ = ["ResponsesEndpoint"]

INLINE_PARSE_BYTES = 64 << 10  # larger bodies are validated on a worker thread (as chat's)


class _PreviousId(msgspec.Struct):
    """Just the field that must be looked up before the request can be validated."""

    previous_response_id: str | None = None


class ResponsesEndpoint:
    def __init__(
        self,
        node: NodeService,
        store: ResponseStore | None = None,
        *,
        admit: Callable[[Request, GenerationJob], GenerationJob] | None = None,
    ) -> None:
        self.node = node
        self.store = store if store is not None else ResponseStore()
        # the app's check and salting of every job (server.max_messages, cache_salt, tenants)
        self._admit = admit

    async def create(self, request: Request) -> Response:
        """`POST /v1/responses` (the app's route table refuses it while the node drains)."""
        body = await request.body()
        try:
            previous_id = msgspec.json.decode(body, type=_PreviousId).previous_response_id
        except msgspec.DecodeError:
            previous_id = None  # the full validation below names the problem
        owner = tenant_name_of(request.scope)  # stored responses are the tenant's own
        history = None
        if previous_id is not None:
            found = self.store.get(previous_id, owner=owner, param="previous_response_id")
            history = found.history
        if len(body) <= INLINE_PARSE_BYTES:
            parsed = parse_responses_request(body, history)
        else:
            parsed = await trio.to_thread.run_sync(parse_responses_request, body, history)
        job = parsed.chat.job if self._admit is None else self._admit(request, parsed.chat.job)
        if job.tenant != owner:
            job = replace(job, tenant=owner)
        if job is not parsed.chat.job:
            parsed = replace(parsed, chat=replace(parsed.chat, job=job))
        access = access_info(request.scope)
        if access is not None:
            access.model = parsed.request.model
        if parsed.stream:
            return ResponsesSSE(self, parsed)
        doc = await self._complete(parsed, request.receive, access)
        return ClientGone() if doc is None else _json(doc)

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        owner = tenant_name_of(request.scope)
        if request.method == "DELETE":
            self.store.delete(response_id, owner=owner)
            return _json({"id": response_id, "object": "response", "deleted": True})
        return _json(self.store.get(response_id, owner=owner).document)

    def keep(self, parsed: ParsedResponsesRequest, doc: dict[str, Any]) -> None:
        """Store `doc` for the tenant its job was served for (`create` set it)."""
        if parsed.request.store is not False:
            history = (*parsed.history, *history_of(doc["output"]))
            self.store.put(doc["id"], history, doc, owner=parsed.chat.job.tenant)

    async def _complete(
        self, parsed: ParsedResponsesRequest, receive: Receive, access: AccessInfo | None
    ) -> dict[str, Any] | None:
        t = await transcribe(self.node, parsed.chat.job, receive, access)
        if t is None:
            return None
        status = "incomplete" if t.finish_reason == "length" else "completed"
        doc = response_object(
            parsed,
            new_item_id("resp"),
            now(),
            status=status,
            output=output_items(t.choice(0)),
            usage=responses_usage(t),
        )
        self.keep(parsed, doc)
        return doc


def _json(doc: dict[str, Any]) -> Response:
    return Response(msgspec.json.encode(doc), media_type="application/json")


class ResponsesSSE(StreamedResponse):
    """A streamed response; errors before the start are ordinary JSON errors."""

    def __init__(self, endpoint: ResponsesEndpoint, parsed: ParsedResponsesRequest) -> None:
        self.endpoint = endpoint
        self.parsed = parsed

    async def _stream(
        self, send: Send, transcripts: list[Transcript], access: AccessInfo | None
    ) -> None:
        parsed, (t,) = self.parsed, transcripts
        async with self.endpoint.node.generate(parsed.chat.job) as events:
            stream = await started_events(events, t)
            await self._start(send)
            writer = ResponsesStreamWriter(parsed, new_item_id("resp"), now())
            try:
                await send(_body(writer.opening(), True))
                await self._send_events(send, stream, access, writer.event)
                failure = finish_error(t)
                if failure is not None:
                    raise failure
                closing = writer.closing(t)
                self.endpoint.keep(parsed, writer.final(t))
                await send(_body(closing, False))
            except ApiError as exc:  # a model that wedges mid-stream, and the like
                await send(_body(writer.error(exc.message, exc.code, exc.param), False))
