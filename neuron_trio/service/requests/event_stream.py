"""A request's stream of events from its model actor: bounded, and never blocking the actor.

Past `capacity` buffered events, a new event is merged into the latest one of its choice (text
and tokens appended), so a slow client costs memory bounded by its own completion and never
stalls the other sequences of the batch.
"""

from __future__ import annotations

from collections import deque

import trio

from neuron_trio.executor.api import SequenceEvent


def merge_events(a: SequenceEvent, b: SequenceEvent) -> SequenceEvent:
    """`b` appended to `a` (same sequence): one event carrying both."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = [*(a.logprobs or ()), *(b.logprobs or ())]
    tool_calls = None
    if a.tool_calls is not None or b.tool_calls is not None:
        tool_calls = [*(a.tool_calls or ()), *(b.tool_calls or ())]
    return SequenceEvent(
        seq_id=b.seq_id,
        text=a.text + b.text,
        token_ids=[*a.token_ids, *b.token_ids],
        logprobs=logprobs,
        finish_reason=b.finish_reason or a.finish_reason,
        prompt_tokens=max(a.prompt_tokens, b.prompt_tokens),
        completion_tokens=max(a.completion_tokens, b.completion_tokens),
        error=b.error or a.error,
        index=b.index,
        tool_calls=tool_calls,
        reasoning=a.reasoning + b.reasoning,
        more_choices=b.more_choices,
        prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs,
    )


class EventStream:
    """A request's events: an async iterator fed by the actor without ever blocking it.

    Iteration ends after the event that carries `finish_reason`, or raises the error the
    actor failed the request with (UnavailableError when the model wedges).
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = max(1, capacity)
        self._buffer: deque[SequenceEvent] = deque()
        self._error: BaseException | None = None
        self._closed = False
        self._lot = trio.lowlevel.ParkingLot()

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, event: SequenceEvent) -> None:
        if self._closed:
            return
        if len(self._buffer) >= self._capacity:
            # merge into the latest event of the same choice (n > 1 interleaves choices)
            for i in range(len(self._buffer) - 1, -1, -1):
                if self._buffer[i].index == event.index:
                    self._buffer[i] = merge_events(self._buffer[i], event)
                    break
            else:
                self._buffer.append(event)  # at most one extra per choice
        else:
            self._buffer.append(event)
        self._lot.unpark_all()

    def close(self) -> None:
        self._closed = True
        self._lot.unpark_all()

    def fail(self, error: BaseException) -> None:
        if self._closed:
            return
        self._error = error
        self.close()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> SequenceEvent:
        while True:
            if self._buffer:
                await trio.lowlevel.checkpoint()
                return self._buffer.popleft()
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._closed:
                raise StopAsyncIteration
            await self._lot.park()
