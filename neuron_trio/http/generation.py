"""Running one completion request against the node: a JSON body, or a server-sent event stream.

Both shapes keep the whole life of `node.generate(job)` inside one trio task (the context may
hold cancel scopes or nurseries of its own), and both watch `receive()` for `http.disconnect`
in a sibling task: under trio, Starlette's `request.is_disconnected()` always says False
(docs/STACK-NOTES.md). A client that goes away cancels the sibling's scope, which leaves the
`generate` context early, which cancels the sequence at the node's next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from neuron_trio.errors import ApiError, UnavailableError
from neuron_trio.http.access_log import AccessInfo, access_info
from neuron_trio.http.openai import (
    SSE_DONE,
    ChunkWriter,
    ParsedRequest,
    Transcript,
    completion_response,
    error_body,
    new_id,
    now,
    sse_data,
)
from neuron_trio.service.api import NodeService, SequenceEvent

__all__ = [
    "ClientGone",
    "GenerationFailedError",
    "SSEResponse",
    "StreamedResponse",
    "complete",
    "run_until_disconnect",
    "started_events",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_FINISHED = ("stop", "length", "tool_calls")


class GenerationFailedError(ApiError):
    """Raised if the engine ended a sequence with an error (500, its reason in the message)."""

    status = 500
    error_type = "server_error"

    def __init__(self, reason: str | None):
        super().__init__(
            f"generation failed: {reason or 'unknown error'}", code="generation_failed"
        )


def _finish_error(t: Transcript) -> ApiError | None:
    """The error a finished sequence ended with, if it did not end normally."""
    if t.finish_reason in _FINISHED:
        return None
    if t.finish_reason == "cancelled":
        return UnavailableError("the node cancelled this request", code="cancelled")
    reason = (
        t.error if t.finish_reason is not None else "the sequence ended without a finish reason"
    )
    log.warning("a sequence ended with %s: %s", t.finish_reason, reason)
    return GenerationFailedError(reason)


async def run_until_disconnect(
    receive: Receive, fn: Callable[[], Awaitable[T]]
) -> tuple[bool, T | None]:
    """Run `fn()` while watching `receive()`; return (client_gone, result).

    If the client disconnects first, `fn` is cancelled and (True, None) comes back. An
    exception from `fn` propagates as itself (not wrapped in an exception group).
    The request body must already have been read: the watcher consumes every message.
    """
    gone = False
    result: T | None = None
    error: Exception | None = None

    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            result = await fn()
        except Exception as exc:
            error = exc
        nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    return gone, result


class ClientGone(Response):
    """Sends nothing: the client disconnected before its response was ready."""

    def __init__(self) -> None:
        pass

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


def _note(access: AccessInfo | None, t: Transcript) -> None:
    """Put what the transcript says into the request's access line."""
    if access is not None:
        access.prompt_tokens = t.prompt_tokens
        access.completion_tokens = t.completion_tokens
        access.finish_reason = t.finish_reason


async def complete(
    node: NodeService, parsed: ParsedRequest, receive: Receive, access: AccessInfo | None = None
) -> dict[str, Any] | None:
    """Run a non-streaming request to its end; the response document, or None if the client left."""
    t = Transcript()

    async def collect() -> Transcript:
        async with node.generate(parsed.job) as events:
            async for event in events:
                t.add(event)
        return t

    try:
        gone, transcript = await run_until_disconnect(receive, collect)
    finally:
        _note(access, t)
    if gone or transcript is None:
        return None
    failure = _finish_error(transcript)
    if failure is not None:
        raise failure
    return completion_response(parsed, new_id(parsed.kind), now(), transcript)


def _body(data: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class StreamedResponse(Response):
    """A generation streamed as server-sent events: the request's `Transcript` fills as
    events arrive and goes to the access log at the end, however the stream ended; a client
    that disconnects cancels the stream (`run_until_disconnect`). Subclasses write `_stream`,
    and start the response only after `started_events` (so a request the node could not serve
    is a plain 503, not a 200 whose only event is an error)."""

    status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        access = access_info(scope)
        transcript = Transcript()

        async def stream() -> None:
            await self._stream(send, transcript, access)

        try:
            await run_until_disconnect(receive, stream)
        finally:
            _note(access, transcript)

    async def _stream(self, send: Send, transcript: Transcript, access: AccessInfo | None) -> None:
        raise NotImplementedError


class SSEResponse(StreamedResponse):
    """A streaming completion as server-sent events, ending in `data: [DONE]`.

    Errors raised while entering `node.generate` (unknown model, queue full, draining) come
    out before the response starts, so they become ordinary JSON error responses. Once the
    stream has started, an error (a wedged model: UnavailableError) is sent as one event
    `data: {"error": {...}}` and the stream ends without `[DONE]`.
    """

    def __init__(self, node: NodeService, parsed: ParsedRequest) -> None:
        self.node = node
        self.parsed = parsed

    async def _stream(self, send: Send, transcript: Transcript, access: AccessInfo | None) -> None:
        parsed = self.parsed
        async with self.node.generate(parsed.job) as events:
            stream = await started_events(events, transcript)
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            writer = ChunkWriter(parsed)
            try:
                opening = writer.opening()
                if opening:
                    await send(_body(opening, True))
                async for event in stream:
                    reason = event.finish_reason
                    if reason is not None and reason not in _FINISHED:
                        break
                    data = writer.event(event, reason)
                    if data:
                        await send(_body(data, True))
                        if access is not None and access.first_token_at is None:
                            access.first_token_at = time.perf_counter()
                failure = _finish_error(transcript)
                if failure is not None:
                    await send(_body(_error_event(failure), False))
                    return
                tail = writer.usage(transcript) if parsed.include_usage else b""
                await send(_body(tail + SSE_DONE, False))
            except ApiError as exc:
                # A model that wedges mid-stream (UnavailableError) and the like.
                await send(_body(_error_event(exc), False))
            except Exception:
                log.exception("stream %s failed", writer.id)
                await send(
                    _body(
                        sse_data(
                            error_body(
                                "internal error", error_type="server_error", code="internal_error"
                            )
                        ),
                        False,
                    )
                )


async def _first_event(events: AsyncIterator[SequenceEvent], t: Transcript) -> SequenceEvent | None:
    """The stream's first event, awaited before its response starts: a request the node could
    not serve (the model wedged or was stopped while the request waited: UnavailableError; or a
    sequence that ended at once, abnormally) is then a plain 503 with Retry-After, which a
    router retries on another node (deploy/haproxy/), not a 200 whose only event is an error.
    None if the events ended without any. Raises what the node raised, or the finish error of
    a first event that ends the request abnormally."""
    try:
        event = await events.__anext__()
    except StopAsyncIteration:
        return None
    t.add(event)
    if event.finish_reason is not None and event.finish_reason not in _FINISHED:
        failure = _finish_error(t)
        if failure is not None:
            raise failure
    return event


async def started_events(
    events: AsyncIterable[SequenceEvent], t: Transcript
) -> AsyncIterator[SequenceEvent]:
    """Await the stream's first event (`_first_event`: a request the node could not serve
    raises here, before any response starts), then iterate every event, each added to `t`."""
    stream = aiter(events)
    first = await _first_event(stream, t)

    async def all_events() -> AsyncIterator[SequenceEvent]:
        if first is not None:
            yield first
        async for event in stream:
            t.add(event)
            yield event

    return all_events()


def _error_event(exc: ApiError) -> bytes:
    return sse_data(
        error_body(exc.message, error_type=exc.error_type, code=exc.code, param=exc.param)
    )
