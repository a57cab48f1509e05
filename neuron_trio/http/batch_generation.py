"""Running a `/v1/completions` batch (several prompts, or `echo`) against the node.

Each prompt is one `node.generate` job; they run together (the model batches them like any
concurrent requests). Every job is queued before the response starts, so a refusal (unknown
model, full queue, a prompt too long) is an ordinary JSON error and no job is left running:
leaving the exit stack cancels the jobs already queued. As in `generation`, `receive()` is
watched for `http.disconnect` in a sibling task, and one task owns every `generate` context.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

import trio
from starlette.types import Receive, Send

from neuron_trio.errors import ApiError
from neuron_trio.http.access_log import AccessInfo
from neuron_trio.http.generation import (
    StreamedResponse,
    _body,
    _error_event,
    finish_error,
    note_transcripts,
    run_until_disconnect,
)
from neuron_trio.http.openai import SSE_DONE, Transcript
from neuron_trio.http.openai.completion_batch import BatchWriter, CompletionBatch
from neuron_trio.service.api import GOOD_FINISH_REASONS, NodeService, SequenceEvent

__all__ = ["BatchSSEResponse", "complete_batch", "with_echo_texts"]

log = logging.getLogger(__name__)


_Item = tuple[int, SequenceEvent | ApiError]  # (prompt, what its stream said)


async def with_echo_texts(node: NodeService, batch: CompletionBatch) -> CompletionBatch:
    """`batch` with the text of each token-id prompt it echoes (the node's tokenizer: the
    HTTP layer holds none), before any job is queued."""
    echo = batch.echo
    if echo is None or all(text is not None for text in echo):
        return batch
    texts = list(echo)
    for i, part in enumerate(batch.parts):
        ids = part.job.prompt_ids
        if texts[i] is None and ids is not None:
            texts[i] = await node.detokenize(part.job.model, ids)
    return replace(batch, echo=tuple(texts))


async def _open_all(stack: AsyncExitStack, node: NodeService, batch: CompletionBatch) -> list[Any]:
    return [await stack.enter_async_context(node.generate(p.job)) for p in batch.parts]


async def complete_batch(
    node: NodeService, batch: CompletionBatch, receive: Receive, access: AccessInfo | None
) -> dict[str, Any] | None:
    """Run every prompt to its end; the response document, or None if the client left."""
    batch = await with_echo_texts(node, batch)
    transcripts = [Transcript() for _ in batch.parts]

    async def collect() -> None:
        errors: list[ApiError] = []
        async with AsyncExitStack() as stack:
            streams = await _open_all(stack, node, batch)
            async with trio.open_nursery() as nursery:
                for stream, t in zip(streams, transcripts, strict=True):
                    nursery.start_soon(_drain, stream, t, errors, nursery.cancel_scope)
        if errors:  # raised here, not in a child: trio would wrap it in an exception group
            raise errors[0]

    try:
        gone, _ = await run_until_disconnect(receive, collect)
    finally:
        note_transcripts(access, transcripts)
    if gone:
        return None
    for t in transcripts:
        failure = finish_error(t)
        if failure is not None:
            raise failure
    return BatchWriter(batch).body(transcripts)


async def _drain(
    stream: Any, t: Transcript, errors: list[ApiError], scope: trio.CancelScope
) -> None:
    try:
        async for event in stream:
            t.add(event)
    except ApiError as exc:  # a model that wedges: the whole request fails with it
        errors.append(exc)
        scope.cancel()


class BatchSSEResponse(StreamedResponse):
    """A streaming batch: every prompt's chunks as they come, one `[DONE]` at the end.

    Every prompt is queued before the response starts; a failure of any prompt after that
    (a wedged model) ends the whole stream with one error event.
    """

    def __init__(self, node: NodeService, batch: CompletionBatch) -> None:
        self.node = node
        self.batch = batch
        self.streams = len(batch.parts)

    async def _stream(
        self, send: Send, transcripts: list[Transcript], access: AccessInfo | None
    ) -> None:
        self.batch = await with_echo_texts(self.node, self.batch)
        writer = BatchWriter(self.batch)
        async with AsyncExitStack() as stack:
            streams = await _open_all(stack, self.node, self.batch)
            await self._start(send)
            sender, receiver = trio.open_memory_channel[_Item](0)
            error: ApiError | None = None
            async with trio.open_nursery() as nursery:
                for part, events in enumerate(streams):
                    nursery.start_soon(_forward, part, events, sender.clone())
                sender.close()
                async with receiver:
                    async for part, item in receiver:
                        if isinstance(item, ApiError):  # a model that wedges mid-stream
                            error = item
                            nursery.cancel_scope.cancel()
                            break
                        transcripts[part].add(item)
                        reason = item.finish_reason
                        if reason is not None and reason not in GOOD_FINISH_REASONS:
                            nursery.cancel_scope.cancel()
                            break
                        data = writer.chunks(part, item, reason)
                        if data:
                            await self._send_chunk(send, data, access)
            if error is not None:
                await send(_body(_error_event(error), False))
                return
            for t in transcripts:
                failure = finish_error(t)
                if failure is not None:
                    await send(_body(_error_event(failure), False))
                    return
            tail = writer.usage_chunk(transcripts) if self.batch.first.include_usage else b""
            await send(_body(tail + SSE_DONE, False))


async def _forward(part: int, events: Any, sender: trio.MemorySendChannel[_Item]) -> None:
    """Pass prompt `part`'s events on; an ApiError too, as an item (raised in a child task,
    trio would wrap it in an exception group)."""
    async with sender:
        try:
            async for event in events:
                await sender.send((part, event))
        except ApiError as exc:
            await sender.send((part, exc))
