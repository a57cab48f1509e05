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
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
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
from neuron_trio.service.api import (
    GOOD_FINISH_REASONS,
    GenerationJob,
    NodeService,
    SequenceEvent,
)

__all__ = [
    "ClientGone",
    "GenerationFailedError",
    "SSEResponse",
    "StreamedResponse",
    "complete",
    "finish_error",
    "note_transcripts",
    "run_until_disconnect",
    "started_events",
    "transcribe",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class GenerationFailedError(ApiError):
    """Raised if the engine ended a sequence with an error (500, its reason in the message)."""

    status = 500
    error_type = "server_error"

    def __init__(self, reason: str | None):
        super().__init__(
            f"generation failed: {reason or 'unknown error'}", code="generation_failed"
        )


def finish_error(t: Transcript) -> ApiError | None:
    """The error a finished sequence ended with, if it did not end normally."""
    if t.finish_reason in GOOD_FINISH_REASONS:
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


def note_transcripts(access: AccessInfo | None, transcripts: Sequence[Transcript]) -> None:
    """Put what a request's transcripts say into its access line: tokens summed over them (a
    completions batch has one a prompt), the finish reason of the first that ended abnormally,
    else the first one's."""
    if access is None:
        return
    access.prompt_tokens = sum(t.prompt_tokens for t in transcripts)
    access.completion_tokens = sum(t.completion_tokens for t in transcripts)
    access.finish_reason = next(
        (t.finish_reason for t in transcripts if t.finish_reason not in GOOD_FINISH_REASONS),
        transcripts[0].finish_reason if transcripts else None,
    )


async def transcribe(
    node: NodeService, job: GenerationJob, receive: Receive, access: AccessInfo | None
) -> Transcript | None:
    """Run `job` to its end: its transcript, or None if the client left first. Raises the
    error the node or the sequence ended with (`finish_error`)."""
    t = Transcript()

    async def collect() -> None:
        async with node.generate(job) as events:
            async for event in events:
                t.add(event)

    try:
        gone, _ = await run_until_disconnect(receive, collect)
    finally:
        note_transcripts(access, [t])
    if gone:
        return None
    failure = finish_error(t)
    if failure is not None:
        raise failure
    return t


async def complete(
    node: NodeService, parsed: ParsedRequest, receive: Receive, access: AccessInfo | None = None
) -> dict[str, Any] | None:
    """Run a non-streaming request to its end; the response document, or None if the client left."""
    transcript = await transcribe(node, parsed.job, receive, access)
    if transcript is None:
        return None
    return completion_response(parsed, new_id(parsed.kind), now(), transcript)


def _body(data: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class StreamedResponse(Response):
    """A generation streamed as server-sent events: the request's `Transcript`s (one a
    generation it streams: `streams`) fill as events arrive and go to the access log at the
    end, however the stream ended; a client that disconnects cancels the stream
    (`run_until_disconnect`). Subclasses write `_stream`, and start the response only after
    `started_events` or once every generation is queued (so a request the node could not
    serve is a plain error response, not a 200 whose only event is an error)."""

    status_code = 200
    streams = 1  # the generations this response carries (a completions batch: several)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        access = access_info(scope)
        transcripts = [Transcript() for _ in range(self.streams)]

        async def stream() -> None:
            await self._stream(send, transcripts, access)

        try:
            await run_until_disconnect(receive, stream)
        finally:
            note_transcripts(access, transcripts)

    async def _stream(
        self, send: Send, transcripts: list[Transcript], access: AccessInfo | None
    ) -> None:
        raise NotImplementedError

    @staticmethod
    async def _start(send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})

    @staticmethod
    async def _send_chunk(send: Send, data: bytes, access: AccessInfo | None) -> None:
        """One chunk, more to follow; the first one's time goes to the access line."""
        await send(_body(data, True))
        if access is not None and access.first_token_at is None:
            access.first_token_at = time.perf_counter()

    async def _send_events(
        self,
        send: Send,
        events: AsyncIterable[SequenceEvent],
        access: AccessInfo | None,
        chunks: Callable[[SequenceEvent], bytes],
    ) -> None:
        """Each event's `chunks`, up to the last event or one that ends the request
        abnormally (its error is then the transcript's: `finish_error`)."""
        async for event in events:
            reason = event.finish_reason
            if reason is not None and reason not in GOOD_FINISH_REASONS:
                break
            data = chunks(event)
            if data:
                await self._send_chunk(send, data, access)


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

    async def _stream(
        self, send: Send, transcripts: list[Transcript], access: AccessInfo | None
    ) -> None:
        parsed, (transcript,) = self.parsed, transcripts
        async with self.node.generate(parsed.job) as events:
            stream = await started_events(events, transcript)
            await self._start(send)
            writer = ChunkWriter(parsed)
            try:
                opening = writer.opening()
                if opening:
                    await send(_body(opening, True))
                await self._send_events(
                    send, stream, access, lambda event: writer.event(event, event.finish_reason)
                )
                failure = finish_error(transcript)
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
    if event.finish_reason is not None and event.finish_reason not in GOOD_FINISH_REASONS:
        failure = finish_error(t)
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
