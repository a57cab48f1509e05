"""A model actor's requests: the queue in front of the engine and the sequences running in it.

The `RequestTable` is the actor's bookkeeping, apart from its loop: where each request is
(queued, running, finished), what its consumer still holds, the outcome each one is counted
under, and how each engine event reaches its request's `EventStream`. Only the actor's loop
(on the trio thread) moves requests between the queue and the engine, between steps;
`inflight()` alone may be called from any thread (forensics).

Admission is fair between tenants (issue 47): the next request admitted is the oldest of the
waiting tenant with the smallest virtual token counter (`engine/fair_share.py`), which the
table charges with each request's prompt at admission and its output as it is routed; the
same counters order the engine's prefills and preemptions (`engine.share_fairly`). A
tenant's own limits (`service/requests/tenant_limits.py`) hold its requests at `max_sequences` and
refuse them past `max_queued` or `tokens_per_minute`. While a tenant seen before runs
nothing, a tenant already running never takes the last free slot: the other's next request
then starts at the next step instead of after a long stream ends. Without tenants (all None)
admission is first come, first served, as before.

Running streams keep their slots, so admission alone cannot serve a lighter tenant while a
heavier one holds every slot with long streams. Then (`_park_for_lighter`, at most one per
step) the heaviest running tenant's youngest stream is parked (`engine.park`: preempted, its
full blocks stay cached) and its slot goes to the lighter tenant's waiting request. A parked
request waits as its tenant's oldest and resumes at its tenant's turn; its client sees a
pause, not a token changed. Against thrash, a stream is parked only after it produced
`MIN_TOKENS_BEFORE_PARK` tokens since it last started, and only while its tenant would still
hold at least the other's slots (over the weights): two equal tenants settle at equal halves.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio

from neuron_trio.errors import UnavailableError
from neuron_trio.executor.api import FairShare, PreparedPrompt, SequenceEvent, ServingEngine
from neuron_trio.service.api import GenerationJob
from neuron_trio.service.metrics.model import ModelMetrics
from neuron_trio.service.requests.event_stream import EventStream
from neuron_trio.service.requests.tenant_limits import TenantLimits, TenantPolicy
from neuron_trio.service.wedge.records import InflightRequest

# Tenants remembered for the last-slot rule: names come from the configuration (bounded there);
# this is a second bound on memory.
MAX_TENANTS_SEEN = 4096
# A stream runs at least this many tokens after it is admitted or resumed before it may be
# parked: each park costs a recompute of its prompt's last partial block and its output.
MIN_TOKENS_BEFORE_PARK = 8


@dataclass(eq=False)
class ActorRequest:
    """One request from `ModelActor.generate` until its stream ends."""

    job: GenerationJob
    prompt: PreparedPrompt  # checked once, on arrival (`prompt_intake`): `engine.add` trusts it
    stream: EventStream
    enqueued_at: float  # trio clock (metrics)
    enqueued_wall: float = 0.0  # time.time() (forensics, read from other threads)
    seq_id: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    started_at_tokens: int = 0  # `tokens` when it last started running (admitted, resumed)
    done: bool = False
    outcome: str = ""


class RequestTable:
    """The queued and running requests of one model, and the counting of their outcomes.

    `wake` is called when the actor's loop has something new to do (a cancellation).
    """

    def __init__(
        self,
        name: str,
        metrics: ModelMetrics | None,
        wake: Callable[[], None],
        tenants: Mapping[str, TenantPolicy] | None = None,
    ) -> None:
        self.name = name
        self._metrics = metrics
        self._wake = wake
        # Invariant: a request is in `queue` (no seq_id yet, in arrival order) or in `active`
        # (keyed by its engine seq_id), never both; only the actor's loop moves it between
        # them, between steps, and it leaves both when its stream ends.
        self.queue: deque[ActorRequest] = deque()
        self.active: dict[int, ActorRequest] = {}
        # Requests taken out of the engine for a lighter tenant (`engine.park`), parked
        # first; they keep their seq_id, and wait beside `queue` as their tenant's oldest.
        self.parked: dict[int, ActorRequest] = {}
        self.cancels: list[int] = []  # seq_ids to cancel in the engine at the next boundary
        self._open = 0  # generate() contexts not yet left
        self._idle_lot = trio.lowlevel.ParkingLot()
        self.limits = TenantLimits(tenants)
        self.fair = FairShare({n: p.weight for n, p in self.limits.policies.items()})
        self._seen: set[str | None] = set()  # tenants that sent requests (names: bounded)

    @property
    def engine_idle(self) -> bool:
        """No request queued or running (consumers may still read their last events)."""
        return not self.queue and not self.active and not self.parked

    @property
    def idle(self) -> bool:
        """No request queued, running, or still being read by its consumer."""
        return self.engine_idle and not self._open

    def count(self, outcome: str, tenant: str | None = None) -> None:
        """Count a request's `outcome`, for its model and for its tenant."""
        if self._metrics is not None:
            self._metrics.outcome(outcome)
            self._metrics.tenants.outcome(tenant, outcome)

    # ---- a request's life ------------------------------------------------------------------

    def check_limits(self, tenant: str | None, max_batch: int) -> None:
        """TenantLimitError (429) if a new request of `tenant` is past one of its limits."""
        queued = sum(1 for r in self.queue if r.job.tenant == tenant)
        self.limits.check(
            tenant,
            trio.current_time(),
            queued=queued,
            running=self.running(tenant),
            max_batch=max_batch,
        )

    def running(self, tenant: str | None) -> int:
        """Sequences of `tenant` in the engine (a request of n choices runs n)."""
        return sum(r.job.params.n for r in self.active.values() if r.job.tenant == tenant)

    def enqueue(self, request: ActorRequest) -> None:
        """`request` waits for the engine; its consumer holds it until `leave`."""
        tenant = request.job.tenant
        if len(self._seen) < MAX_TENANTS_SEEN:
            self._seen.add(tenant)
        self.fair.arrive(tenant)
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
        self.fair.leave(request.job.tenant)
        if request.seq_id is not None and outcome != "cancelled":
            self.active.pop(request.seq_id, None)
            self.parked.pop(request.seq_id, None)
        self.count(outcome, request.job.tenant)
        m = self._metrics
        if m is not None and request.tokens > 1:
            assert request.first_token_at is not None and request.last_token_at is not None
            span = request.last_token_at - request.first_token_at
            m.per_output_token(span / (request.tokens - 1))
        self._idle_lot.unpark_all()

    def fail_all(self, error: UnavailableError) -> None:
        """Every queued and running request ends with `error` (a wedge, an unload)."""
        for request in [*self.queue, *self.parked.values(), *self.active.values()]:
            request.stream.fail(error)
            self.finish(request, "unavailable")
        self.queue.clear()
        self.parked.clear()
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
            self.parked.pop(seq_id, None)
        self.cancels.clear()

    def admit(self, engine: ServingEngine) -> None:
        """Start waiting requests while slots are free; then, if a lighter tenant still
        waits, park one stream of the heaviest and give the lighter its slot."""
        self._admit_waiting(engine)
        if self._park_for_lighter(engine):
            self._admit_waiting(engine)

    def _admit_waiting(self, engine: ServingEngine) -> None:
        # A request of n choices takes n of max_batch at once (its prompt is prefilled once,
        # shared), and waits until the KV pool has its prompt's blocks.
        while (request := self._next_admission(engine.free_slots)) is not None:
            if request.seq_id is not None:  # parked: its prompt was charged when admitted
                if not engine.can_admit(len(request.prompt.ids) + request.tokens):
                    return
                engine.resume(request.seq_id)
                self.active[request.seq_id] = self.parked.pop(request.seq_id)
                request.started_at_tokens = request.tokens
                continue
            tokens = len(request.prompt.ids)
            if not engine.can_admit(tokens, request.job.params.n):
                return
            self.queue.remove(request)
            tenant = request.job.tenant
            # can_admit found its n slots; the prompt was checked on arrival
            seq_id = engine.add(request.prompt, cache_salt=request.job.cache_salt, tenant=tenant)
            request.seq_id = seq_id
            self.active[seq_id] = request
            self.fair.charge(tenant, prompt=tokens)
            self.limits.used(tenant, trio.current_time(), tokens)
            if self._metrics is not None:
                self._metrics.admitted(tokens)
                waited = trio.current_time() - request.enqueued_at
                self._metrics.tenants.admitted(tenant, tokens, waited)

    def _heads(self) -> dict[str | None, ActorRequest]:
        """Each waiting tenant's next request: its oldest parked one, else its oldest queued."""
        heads: dict[str | None, ActorRequest] = {}
        for request in [*self.parked.values(), *self.queue]:  # parked ones are the older
            heads.setdefault(request.job.tenant, request)
        return heads

    def _next_admission(self, free_slots: int) -> ActorRequest | None:
        """The oldest waiting request of the lightest tenant that may start one now."""
        heads = self._heads()
        startable = [t for t, r in heads.items() if self._may_start(t, r.job.params.n, free_slots)]
        if not startable:
            return None
        # Equal counters (a tenant just lifted from idle): the one running fewer goes first.
        startable.sort(key=self.running)
        return heads[self.fair.pick(startable)]

    def _park_for_lighter(self, engine: ServingEngine) -> bool:
        """With too few slots free for the lightest waiting tenant that could start, park
        the youngest parkable stream of the heaviest running tenant (by the counters), if
        that tenant would keep at least the lighter one's slots (over their weights)."""
        heads = self._heads()
        running = {r.job.tenant for r in self.active.values()}
        if len(running | heads.keys()) < 2:
            return False  # one tenant (or none): first come, first served
        free = engine.free_slots
        waiting = [
            t
            for t, r in heads.items()
            if free < r.job.params.n and self._may_start(t, r.job.params.n, r.job.params.n)
        ]
        if not waiting or not running:
            return False
        fair = self.fair
        light = fair.pick(sorted(waiting, key=self.running))
        # The victim's tenant: served at least as much as `light` (equal counters: a tenant
        # lifted from idle to the flood's), holding the most slots over its weight.
        heavier = [t for t in running if t != light and fair.counter(t) >= fair.counter(light)]
        if not heavier:
            return False
        heavy = max(heavier, key=lambda t: (self.running(t) / fair.weight(t), fair.counter(t)))
        # (one park a step: a request of n choices gets its n slots over n steps)
        after = (self.running(heavy) - 1) / fair.weight(heavy)
        if after < (self.running(light) + 1) / fair.weight(light):
            return False  # the heavier would end below the lighter's share: no ping-pong
        for request in reversed(list(self.active.values())):  # the youngest first
            if request.job.tenant != heavy or request.job.params.n != 1:
                continue
            if request.tokens - request.started_at_tokens < MIN_TOKENS_BEFORE_PARK:
                continue
            assert request.seq_id is not None
            if engine.park(request.seq_id):
                del self.active[request.seq_id]
                self.parked[request.seq_id] = request
                return True
        return False

    def _may_start(self, tenant: str | None, n: int, free_slots: int) -> bool:
        running = self.running(tenant)
        if not running:
            return True  # a tenant's first sequences always may (n is bounded by max_batch)
        limit = self.limits.policy(tenant).max_sequences
        if limit is not None and running + n > limit:
            return False
        # The last free slot is kept while a tenant seen before runs nothing (idle, or its
        # request waiting: counters alone would give the slot to a flood whose long prompts,
        # still prefilling, have not been charged for any output yet), so that its request
        # starts at the next step, not once a long stream of this tenant ends.
        return free_slots - n >= 1 or not self._someone_runs_nothing()

    def _someone_runs_nothing(self) -> bool:
        """Some tenant seen on this model has no sequence in the engine."""
        return len(self._seen) > 1 and any(not self.running(t) for t in self._seen)

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
                self.fair.charge(request.job.tenant, output=n)
                self.limits.used(request.job.tenant, now, n)
                if self._metrics is not None:
                    self._metrics.generated(n)
                    self._metrics.tenants.generated(request.job.tenant, n)
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
                state="running" if r.seq_id in self.active else "queued",
                age_s=round(now - r.enqueued_wall, 3),
                prompt_tokens=len(r.prompt.ids),
                generated_tokens=r.tokens,
            )
            for r in [*list(self.active.values()), *list(self.parked.values()), *list(self.queue)]
        ]
