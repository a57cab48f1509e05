"""Admission between tenants (service/requests/request_table.py with engine/fair_share.py) and each
tenant's own limits (service/requests/tenant_limits.py), over the fake engine; time is a MockClock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from neuron_trio.config import ModelConfig
from neuron_trio.engine.types import SamplingParams
from neuron_trio.errors import QueueFullError, UnavailableError
from neuron_trio.service.api import GenerationJob
from neuron_trio.service.model_actor import ModelActor
from neuron_trio.service.requests.event_stream import EventStream
from neuron_trio.service.requests.request_table import (
    MIN_TOKENS_BEFORE_PARK,
    ActorRequest,
    RequestTable,
)
from neuron_trio.service.requests.tenant_limits import (
    TenantLimitError,
    TenantPolicy,
    TokenWindow,
    policies_from_config,
)

from .fakes import FakeEngine, FakeExecutor


def _run(test: Callable[[trio.testing.MockClock], Awaitable[None]]) -> None:
    clock = trio.testing.MockClock()
    trio.run(test, clock, clock=clock)


def _request(tenant: str | None, *, prompt: int = 4, max_tokens: int = 3) -> ActorRequest:
    job = GenerationJob(
        model="m", params=SamplingParams(max_tokens=max_tokens), prompt="x", tenant=tenant
    )
    prepared = FakeEngine(1, context=100_000).prepare(job.params, ids=[7] * prompt)
    return ActorRequest(job, prepared, EventStream(1024), trio.current_time())


def _table(tenants: dict[str, TenantPolicy] | None = None) -> RequestTable:
    return RequestTable("m", None, lambda: None, tenants)


class Node:
    """A request table in front of a fake engine, driven step by step as the actor's loop."""

    def __init__(self, max_batch: int, tenants: dict[str, TenantPolicy] | None = None) -> None:
        self.engine = FakeEngine(max_batch, context=100_000)
        self.table = _table(tenants)
        self.engine.share_fairly(self.table.fair)
        self.tokens: Counter[str | None] = Counter()

    def send(self, tenant: str | None, count: int = 1, **kw: Any) -> list[ActorRequest]:
        out = [_request(tenant, **kw) for _ in range(count)]
        for request in out:
            self.table.enqueue(request)
        return out

    def step(self) -> None:
        self.table.apply_cancels(self.engine)
        self.table.admit(self.engine)
        events = self.engine.step()
        for event in events:
            request = self.table.active.get(event.seq_id)
            if request is not None:
                self.tokens[request.job.tenant] += len(event.token_ids)
        self.table.route(events)

    @property
    def admitted(self) -> list[str | None]:
        return self.engine.tenants


def test_a_flooding_tenant_does_not_push_another_behind_its_queue() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=4)
        node.send("flood", 50, prompt=500, max_tokens=5)
        node.step()
        assert node.admitted == ["flood"] * 4
        node.step()
        node.send("other", 1)
        while len(node.admitted) == 4:
            node.step()
        # first come, first served would admit the 46 other long requests first
        assert node.admitted[4] == "other"

    _run(main)


def test_without_tenants_admission_is_first_come_first_served() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=2)
        sent = node.send(None, 6, max_tokens=2)
        while node.table.queue or node.table.active:
            node.step()
        assert node.engine.added == [list(r.prompt.ids) for r in sent]
        assert [r.seq_id for r in sent] == sorted(r.seq_id for r in sent if r.seq_id)

    _run(main)


def test_weights_two_to_one_give_two_to_one_service_under_backlog() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=6, tenants={"gold": TenantPolicy(weight=2.0)})
        for _ in range(200):  # interleaved arrivals: first come, first served would be 1:1
            node.send("gold", max_tokens=4)
            node.send("bronze", max_tokens=4)
        for _ in range(150):
            node.step()
        ratio = node.tokens["gold"] / node.tokens["bronze"]
        assert 1.8 <= ratio <= 2.2, node.tokens

    _run(main)


def test_max_sequences_holds_a_tenants_requests_while_others_go_by() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=4, tenants={"capped": TenantPolicy(max_sequences=1)})
        node.send("capped", 3, max_tokens=3)
        node.send("free", 1, max_tokens=3)
        node.step()
        assert node.admitted == ["capped", "free"]
        assert node.table.running("capped") == 1
        for _ in range(3):
            node.step()  # the first capped request ends after 3 tokens
        assert node.admitted == ["capped", "free", "capped"]

    _run(main)


def test_the_last_slot_is_kept_while_another_tenant_is_idle() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=4)
        node.send("b", 1, max_tokens=1)
        node.step()  # b has been seen, and is idle again
        node.send("a", 10, max_tokens=1000)
        node.step()
        assert node.table.running("a") == 3  # not 4: b's next request starts at once
        node.send("b", 1, max_tokens=3)
        node.step()
        assert node.table.running("b") == 1
        node.send("c", 1, max_tokens=3)  # a third tenant, first seen now: it waits its turn
        node.step()
        assert node.table.running("c") == 0

    _run(main)


def test_the_last_slot_goes_to_a_waiting_tenant_that_runs_nothing_whatever_the_counters() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=4)
        node.send("calm", 1, max_tokens=1)
        node.step()  # calm has been seen; everyone idle again
        node.send("flood", 10, max_tokens=1000)
        node.step()
        assert node.table.running("flood") == 3
        node.send("calm", 1, prompt=3000, max_tokens=2)  # calm's counter now far above
        node.step()
        node.step()  # that request is over: calm runs nothing, its slot is free
        assert node.table.running("calm") == 0
        assert node.table.fair.counter("calm") > node.table.fair.counter("flood")
        node.send("calm", 1, max_tokens=3)
        node.step()
        # by counters alone flood (lighter) would take the slot; calm would wait for a
        # 1000-token stream to end
        assert node.table.running("calm") == 1 and node.table.running("flood") == 3

    _run(main)


def test_past_max_queued_a_tenant_gets_a_429_naming_the_limit() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=4, tenants={"t": TenantPolicy(max_sequences=2, max_queued=1)})
        node.send("t", 3, max_tokens=50)
        node.step()  # two run, one waits
        with pytest.raises(TenantLimitError) as caught:
            node.table.check_limits("t", max_batch=4)
        assert isinstance(caught.value, QueueFullError)  # the HTTP layer's 429 + Retry-After
        assert caught.value.code == "tenant_max_queued"
        assert caught.value.retry_after_s >= 1
        assert "max_queued" in caught.value.message
        node.table.check_limits("other", max_batch=4)  # another tenant is not limited

    _run(main)


def test_tokens_per_minute_refuses_until_the_window_moves_on() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=4, tenants={"t": TenantPolicy(tokens_per_minute=100)})
        node.send("t", 1, prompt=90, max_tokens=10)
        for _ in range(10):
            node.step()
        clock.jump(20)
        with pytest.raises(TenantLimitError) as caught:
            node.table.check_limits("t", max_batch=4)
        assert caught.value.code == "tenant_tokens_per_minute"
        assert 30 <= caught.value.retry_after_s <= 42  # the tokens of 20 s ago leave at ~60 s
        clock.jump(caught.value.retry_after_s)
        node.table.check_limits("t", max_batch=4)

    _run(main)


def test_the_token_window_is_bounded_and_exact() -> None:
    window = TokenWindow()
    for second in range(600):
        window.add(float(second), 10)
    assert window.used(600.0) == 600  # the last minute only
    assert len(window._buckets) <= 61
    assert window.retry_after(600.0, 600) == pytest.approx(1.0)
    assert window.retry_after(600.0, 601) == 0.0


def test_policies_come_from_the_tenant_entries() -> None:
    class Entry:
        name = "t"
        weight = 3.0
        max_sequences = 2
        max_queued = None
        tokens_per_minute = 1000

    assert policies_from_config([Entry()]) == {
        "t": TenantPolicy(weight=3.0, max_sequences=2, tokens_per_minute=1000)
    }


def test_the_actor_refuses_a_tenant_past_its_limit_with_a_429_and_serves_the_others() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        executor = FakeExecutor(max_batch=2, context=1000)
        spec = ModelConfig(name="m", source="builtin:smollm2-135m", max_batch=2)
        tenants = {"t": TenantPolicy(max_sequences=1, max_queued=0)}
        actor = ModelActor(spec, lambda: executor, max_queue=8, tenants=tenants, burst_gap_s=0)

        def job(tenant: str) -> GenerationJob:
            params = SamplingParams(max_tokens=500)
            return GenerationJob(model="m", params=params, prompt="hi", tenant=tenant)

        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            assert executor.engine.fair is not None  # the engine orders by the same counters
            async with actor.generate(job("t")):
                with pytest.raises(TenantLimitError) as caught:
                    async with actor.generate(job("t")):
                        pass
                assert caught.value.status == 429 and caught.value.code == "tenant_max_queued"
                async with actor.generate(job("u")):
                    pass  # another tenant is not held by t's limits
            nursery.cancel_scope.cancel()

    _run(main)


# ---- parking a heavier tenant's stream for a lighter one -----------------------------------


def _flood_all_slots(node: Node, streams: int = 4) -> None:
    """`flood` holds every slot with long streams, each past MIN_TOKENS_BEFORE_PARK tokens."""
    node.send("flood", streams + 8, max_tokens=1000)
    for _ in range(MIN_TOKENS_BEFORE_PARK + 1):
        node.step()
    assert node.table.running("flood") == node.engine.max_batch


def test_a_lighter_tenant_gets_a_slot_within_one_step_while_a_heavier_holds_them_all() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=4)
        _flood_all_slots(node)  # flood's streams are seq_ids 1-4
        short, long = node.send("calm", 1, max_tokens=5) + node.send("calm", 1, max_tokens=1000)
        node.step()
        # without parking, calm would wait for a 1000-token stream to end
        assert node.table.running("calm") == 1 and short.tokens == 1
        assert node.engine.parks == [4]  # the flood's youngest stream
        first = node.table.parked[4]
        held = first.tokens
        node.step()
        assert node.engine.parks == [4, 3] and long.tokens == 1  # calm: 2 of 4, flood 2
        for _ in range(3):
            node.step()
        assert short.done and short.tokens == 5
        assert first.tokens == held  # parked: nothing produced
        node.step()  # the slot short freed goes to flood's oldest waiting: the first parked
        assert 4 in node.table.active and list(node.table.parked) == [3]
        assert first.tokens == held + 1  # it goes on from where it stopped
        for _ in range(30):
            node.step()
        assert node.engine.parks == [4, 3]  # 2 and 2: nobody is parked again

    _run(main)


@pytest.mark.parametrize("tenant", ["solo", None])
def test_one_tenant_is_never_parked(tenant: str | None) -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=4)
        node.send(tenant, 6, max_tokens=40)
        for _ in range(20):
            node.step()
        node.send(tenant, 6, max_tokens=40)  # newer requests of the same tenant wait
        while not node.table.engine_idle:
            node.step()
        assert node.engine.parks == [] and len(node.engine.added) == 12

    _run(main)


def test_two_equal_tenants_settle_at_half_the_slots_each_without_ping_pong() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=6)
        _flood_all_slots(node, streams=6)
        node.send("calm", 10, max_tokens=1000)
        for _ in range(400):
            node.step()
            assert node.table.running("calm") <= 3  # never more than its half
        assert node.table.running("calm") == 3 and node.table.running("flood") == 3
        # three parks gave calm its half; the counters then never sent a slot back and forth
        assert len(node.engine.parks) == 3, node.engine.parks

    _run(main)


def test_a_parked_request_can_be_cancelled_and_is_failed_on_a_wedge() -> None:
    async def main(clock: trio.testing.MockClock) -> None:
        node = Node(max_batch=2)
        _flood_all_slots(node, streams=2)
        node.send("calm", 2, max_tokens=500)
        node.step()
        (parked,) = node.table.parked.values()
        # the parked one waits again, beside flood's 8 and calm's second
        assert [i.state for i in node.table.inflight()].count("queued") == 1 + 8 + 1
        node.table.leave(parked)  # its client went away
        node.step()
        assert parked.outcome == "cancelled" and not node.table.parked
        assert parked.seq_id in node.engine.cancelled and not node.engine.parked
        assert node.engine.parks == [parked.seq_id]  # 1 and 1: no second park for calm
        wedged = Node(max_batch=2)
        _flood_all_slots(wedged, streams=2)
        wedged.send("calm", 1, max_tokens=500)
        wedged.step()
        (parked,) = wedged.table.parked.values()
        wedged.table.fail_all(UnavailableError("wedged"))
        assert parked.outcome == "unavailable" and wedged.table.engine_idle

    _run(main)
