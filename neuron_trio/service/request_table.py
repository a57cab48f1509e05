"""A model actor's requests: the queue in front of the engine and the sequences running in it.

The `RequestTable` is the actor's bookkeeping, apart from its loop: where each request is
(queued, running, finished), what its consumer still holds, the outcome each one is counted
under, and how each engine event reaches its request's `EventStream`. Only the actor's loop
(on the trio thread) moves requests between the queue and the engine, between steps;
`inflight()` alone may be called from any thread (forensics).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from neuron_trio.engine.types import SequenceEvent
from neuron_trio.errors import NeuronError, UnavailableError
from neuron_trio.executor.api import ServingEngine
from neuron_trio.service.api import GenerationJob
from neuron_trio.service.event_stream import EventStream
from neuron_trio.service.metrics.model import ModelMetrics
from neuron_trio.service.wedge.records import InflightRequest


@dataclass(eq=False)
class ActorRequest:
    """One request from `ModelActor.generate` until its stream ends."""

    job: GenerationJob
    prompt_ids: list[int]
    chat: bool
    stream: EventStream
    enqueued_at: float  # trio clock (metrics)
    enqueued_wall: float = 0.0  # time.time() (forensics, read from other threads)
    seq_id: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    done: bool = False
    outcome: str = ""


class RequestTable:
    """The queued and running requests of one model, and the counting of their outcomes.

    `wake` is called when the actor's loop has something new to do (a cancellation).
    """

    def __init__(self, name: str, metrics: ModelMetrics | None, wake: Callable[[], None]) -> None:
        self.name = name
        self._metrics = metrics
        self._wake = wake
        # Invariant: a request is in `queue` (no seq_id yet, in arrival order) or in `active`
        # (keyed by its engine seq_id), never both; only the actor's loop moves it between
        # them, between steps, and it leaves both when its stream ends.
        self.queue: deque[ActorRequest] = deque()
        self.active: dict[int, ActorRequest] = {}
        self.cancels: list[int] = []  # seq_ids to cancel in the engine at the next boundary
        self._open = 0  # generate() contexts not yet left
        self._idle_lot = trio.lowlevel.ParkingLot()

    @property
    def engine_idle(self) -> bool:
        """No request queued or running (consumers may still read their last events)."""
        return not self.queue and not self.active

    @property
    def idle(self) -> bool:
        """No request queued, running, or still being read by its consumer."""
        return self.engine_idle and not self._open

    def count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.outcome(outcome)

    # ---- a request's life ------------------------------------------------------------------

    def enqueue(self, request: ActorRequest) -> None:
        """`request` waits for the engine; its consumer holds it until `leave`."""
        self.queue.append(request)
        self._open += 1

    def leave(self, request: ActorRequest) -> None:
        """Its consumer left (done, or the client went away)."""
        self._open -= 1
        self._abandon(request)
        self._idle_lot.unpark_all()

    def _abandon(self, request: ActorRequest) -> None:
        """Cancel `request` at the next step boundary (or drop it from the queue at once)."""
        request.stream.close()
        if request.done:
            return
        if request.seq_id is None:
            try:
                self.queue.remove(request)
            except ValueError:
                pass
        else:
            self.cancels.append(request.seq_id)
        self.finish(request, "cancelled")
        self._wake()

    def finish(self, request: ActorRequest, outcome: str) -> None:
        """`request` is over with `outcome` (counted once, whatever ends it first)."""
        if request.done:
            return
        request.done = True
        request.outcome = outcome
        if request.seq_id is not None and outcome != "cancelled":
            self.active.pop(request.seq_id, None)
        self.count(outcome)
        m = self._metrics
        if m is not None and request.tokens > 1:
            assert request.first_token_at is not None and request.last_token_at is not None
            span = request.last_token_at - request.first_token_at
            m.per_output_token(span / (request.tokens - 1))
        self._idle_lot.unpark_all()

    def fail_all(self, error: UnavailableError) -> None:
        """Every queued and running request ends with `error` (a wedge, an unload)."""
        for request in [*self.queue, *self.active.values()]:
            request.stream.fail(error)
            self.finish(request, "unavailable")
        self.queue.clear()
        self.active.clear()
        self._idle_lot.unpark_all()

    async def wait_idle(self) -> None:
        """Return once no request is queued or running."""
        while not self.idle:
            await self._idle_lot.park()

    # ---- between steps (the actor's loop) --------------------------------------------------

    def apply_cancels(self, engine: ServingEngine) -> None:
        for seq_id in self.cancels:
            engine.cancel(seq_id)
            self.active.pop(seq_id, None)
        self.cancels.clear()

    def admit(self, engine: ServingEngine) -> None:
        # A request of n choices takes n of max_batch at once (its prompt is prefilled once,
        # shared), and waits until the KV pool has its prompt's blocks.
        while self.queue and engine.can_admit(
            len(self.queue[0].prompt_ids), self.queue[0].job.params.n
        ):
            request = self.queue.popleft()
            try:
                seq_id = engine.add(
                    request.prompt_ids,
                    request.job.params,
                    chat=request.chat,
                    cache_salt=request.job.cache_salt,
                )
            except NeuronError as exc:  # validated on arrival: should not happen
                request.stream.fail(exc)
                self.finish(request, "error")
                continue
            request.seq_id = seq_id
            self.active[seq_id] = request
            if self._metrics is not None:
                self._metrics.admitted(len(request.prompt_ids))

    def route(self, events: list[SequenceEvent]) -> None:
        """Each event to its request's stream; a request's last event ends it."""
        now = trio.current_time()
        for event in events:
            request = self.active.get(event.seq_id)
            if request is None or request.done:
                continue  # cancelled since the step started
            n = len(event.token_ids)
            if n:
                if request.first_token_at is None:
                    request.first_token_at = now
                    if self._metrics is not None:
                        self._metrics.first_token(now - request.enqueued_at)
                request.last_token_at = now
                request.tokens += n
                if self._metrics is not None:
                    self._metrics.generated(n)
            request.stream.push(event)
            if event.finish_reason is not None and not event.more_choices:
                request.stream.close()
                self.finish(request, event.finish_reason)

    # ---- what others read ------------------------------------------------------------------

    def inflight(self) -> list[InflightRequest]:
        """Queued and running requests with their ages (forensics: any thread may call it)."""
        now = time.time()
        return [
            InflightRequest(
                model=self.name,
                seq_id=r.seq_id,
                state="queued" if r.seq_id is None else "running",
                age_s=round(now - r.enqueued_wall, 3),
                prompt_tokens=len(r.prompt_ids),
                generated_tokens=r.tokens,
            )
            for r in [*list(self.active.values()), *list(self.queue)]
        ]
