"""The Virtual Token Counter (engine/fair_share.py) alone, and the scheduler's prefill order and
preemption by it (issue 47, fair service)."""

from __future__ import annotations

import random

import pytest

from neuron_trio.engine.block_pool import RESERVED_BLOCKS, BlockPool
from neuron_trio.engine.fair_share import OUTPUT_COST, PROMPT_COST, RECENT_S, FairShare
from neuron_trio.engine.scheduler import Scheduler
from neuron_trio.engine.sequence import Sequence, SequenceStatus
from neuron_trio.engine.types import SamplingParams, SequenceEvent
from tests.engine.fake_runner import fake_engine, greedy, prompt_ids, run_alone


def test_service_is_counted_per_weight() -> None:
    fair = FairShare({"big": 2.0})
    fair.arrive("big")
    fair.arrive("small")
    fair.charge("big", prompt=10, output=5)
    fair.charge("small", prompt=10, output=5)
    cost = 10 * PROMPT_COST + 5 * OUTPUT_COST
    assert fair.counter("small") == cost
    assert fair.counter("big") == cost / 2
    assert fair.pick(["small", "big"]) == "big"
    with pytest.raises(ValueError, match="weight"):
        FairShare({"x": 0.0})


def test_ties_go_to_the_first_given() -> None:
    fair = FairShare()
    assert fair.pick(["a", "b"]) == "a"
    assert fair.pick([None]) is None
    with pytest.raises(ValueError):
        fair.pick([])


def test_a_tenant_back_from_idle_is_lifted_to_the_lightest_active_one() -> None:
    fair = FairShare()
    fair.arrive("a")
    fair.arrive("b")
    fair.charge("a", output=100)
    fair.charge("b", output=300)
    fair.arrive("idle")  # back after a long pause: no credit banked
    assert fair.counter("idle") == fair.counter("a") == 200.0
    # a tenant still active is not lifted (its own requests count)
    fair.leave("idle")
    fair.arrive("c")
    fair.charge("c", output=10)
    fair.arrive("c")
    assert fair.counter("c") == 200.0 + 20.0


def test_a_tenant_with_more_credit_than_the_others_keeps_it_when_it_comes_back() -> None:
    fair = FairShare()
    fair.arrive("a")
    fair.charge("a", output=500)
    fair.arrive("b")  # lifted to 1000
    fair.charge("b", output=10)  # 1020
    fair.leave("b")
    fair.arrive("b")  # max(1020, 1000): the lift never lowers a counter
    assert fair.counter("b") == 1020.0


def test_counters_start_over_when_nobody_is_active() -> None:
    fair = FairShare()
    fair.arrive("a")
    fair.charge("a", output=1000)
    fair.leave("a")
    assert fair.counter("a") == 0.0
    fair.arrive("b")
    fair.arrive("a")
    assert fair.counter("a") == fair.counter("b") == 0.0


# ---- the scheduler ------------------------------------------------------------------------


def _seq(seq_id: int, n_prompt: int, tenant: str | None) -> Sequence:
    seq = Sequence(seq_id, list(range(1, n_prompt + 1)), SamplingParams())
    seq.tenant = tenant
    return seq


def test_prefills_go_first_for_the_tenant_holding_fewest_sequences() -> None:
    sched = Scheduler(max_batch=6, prefill_chunk=8, pool=BlockPool(64 + RESERVED_BLOCKS))
    fair = FairShare()
    for t in ("flood", "light"):
        fair.arrive(t)
    fair.charge("light", prompt=1000)  # its counter is no matter: what it holds is
    sched.fair = fair
    seqs = [_seq(i, 8, "flood") for i in (1, 2, 3, 4)] + [_seq(5, 8, "light"), _seq(6, 8, "light")]
    for seq in seqs:
        sched.admit(seq)
    plan = sched.schedule()
    assert [c.seq.seq_id for c in plan.prefill] == [5]  # the light tenant's oldest first
    sched.fair = None  # without tenants: oldest first, as before
    assert [c.seq.seq_id for c in sched.schedule().prefill] == [1]


def test_a_heavier_tenants_long_prompt_does_not_widen_a_lighter_ones_prefill() -> None:
    # a budget of 2,048: the busier tenant's cap (a thirty-second, 64) leaves it room beside
    # the light row, so what is tested is the width it joins with
    sched = Scheduler(max_batch=4, prefill_chunk=2048, pool=BlockPool(96 + RESERVED_BLOCKS))
    fair = FairShare()
    for t in ("heavy", "light"):
        fair.arrive(t)
    sched.fair = fair
    decoding = _seq(3, 16, "heavy")  # the heavy tenant holds two sequences, light one
    sched.admit(decoding)
    sched.schedule()
    decoding.prefilled, decoding.status = 16, SequenceStatus.DECODING
    decoding.output_ids.append(0)
    long, short = _seq(1, 500, "heavy"), _seq(2, 23, "light")
    short.output_ids.append(7)  # preempted after its first token: this prefill samples none
    for seq in (long, short):
        sched.admit(seq)
    spans = [(c.seq.seq_id, c.start, c.end) for c in sched.schedule().prefill]
    # first come, first served: (1, 0, 64) alone, the light prompt a step later; joined
    # without the rule: (2, 0, 23), (1, 0, 32): the light row padded to 32
    assert spans == [(2, 0, 23), (1, 0, 23)]


def test_a_lighter_tenants_first_token_gets_a_step_of_its_own() -> None:
    # The calm tenant's prompt completes this step: the flood's decode rows and its prefill
    # chunk wait one step (keeping their blocks), so calm's first token costs what it costs
    # on an idle node. A step that samples nobody's first token is shared as before.
    sched = Scheduler(max_batch=6, prefill_chunk=256, pool=BlockPool(128 + RESERVED_BLOCKS))
    fair = FairShare(clock=lambda: 0.0)
    for t in ("flood", "calm"):
        fair.arrive(t)
    sched.fair = fair
    rows = [_seq(i, 16, "flood") for i in (1, 2, 3)]
    for seq in rows:
        sched.admit(seq)
    sched.schedule()
    for seq in rows:
        seq.prefilled, seq.status = 16, SequenceStatus.DECODING
        seq.output_ids.append(0)
    long = _seq(4, 300, "flood")
    sched.admit(long)
    plan = sched.schedule()
    assert [s.seq_id for s in plan.decode] == [1, 2, 3] and plan.prefill[0].seq is long
    long.prefilled = plan.prefill[0].end
    calm = _seq(5, 20, "calm")
    sched.admit(calm)
    plan = sched.schedule()
    assert plan.decode == [] and [(c.seq.seq_id, c.start, c.end) for c in plan.prefill] == [
        (5, 0, 20)
    ]
    calm.prefilled, calm.status = 20, SequenceStatus.DECODING
    calm.output_ids.append(0)
    blocks = [list(s.blocks) for s in rows]
    # another light tenant's first token right after: the flood waited the step before, so
    # this one is shared (never two steps running: arrivals cannot starve it)
    fair.arrive("third")
    third = _seq(7, 20, "third")
    sched.admit(third)
    plan = sched.schedule()
    assert [s.seq_id for s in plan.decode] == [1, 2, 3, 5]
    assert [c.seq.seq_id for c in plan.prefill] == [7]  # (the flood's chunk: too wide to join)
    sched.release(third)
    sched.fair = None  # one tenant: nobody waits
    calm2 = _seq(6, 20, "calm")
    sched.admit(calm2)
    plan = sched.schedule()
    assert [s.seq_id for s in plan.decode] == [1, 2, 3, 5]
    assert [list(s.blocks) for s in rows] == blocks  # the rows that waited kept their blocks


def test_a_busier_tenants_prefill_steps_stay_short_while_another_has_been_served() -> None:
    # The other tenant's next request, arriving during a step, waits for that step: a
    # thirty-second of the budget, not a whole 256-token chunk of the flood's long prompt.
    sched = Scheduler(max_batch=4, prefill_chunk=256, pool=BlockPool(128 + RESERVED_BLOCKS))
    fair = FairShare(clock=lambda: 0.0)
    fair.arrive("flood")
    fair.charge("flood", prompt=500)
    sched.fair = fair
    flood = _seq(1, 500, "flood")
    sched.admit(flood)
    assert [(c.start, c.end) for c in sched.schedule().prefill] == [(0, 256)]  # one tenant
    flood.prefilled = 256  # (the engine advances it after the step)
    fair.arrive("calm")
    fair.charge("calm", prompt=10)
    fair.leave("calm")  # served, now between requests: it holds nothing
    assert [(c.start, c.end) for c in sched.schedule().prefill] == [(256, 256 + 8)]
    second = _seq(3, 500, "flood")
    sched.admit(second)  # the cap bounds the step, not each row: no second row of 8
    assert [(c.seq.seq_id, c.end) for c in sched.schedule().prefill] == [(1, 256 + 8)]
    sched.release(second)
    sched.admit(_seq(2, 300, "calm"))  # each holds one now: neither is capped
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefill] == [(1, 256, 500)]


def test_a_tenant_gone_idle_keeps_the_flood_steps_short_for_a_few_seconds() -> None:
    # The drill's calm tenant: its requests end, the node goes idle (counters cleared), a
    # flood of long prompts starts; calm's next request, a moment later, must not wait behind
    # a 256-token step. RECENT_S after calm's last request, the flood has the whole budget.
    now = [0.0]
    sched = Scheduler(max_batch=4, prefill_chunk=256, pool=BlockPool(128 + RESERVED_BLOCKS))
    fair = FairShare(clock=lambda: now[0])
    fair.arrive("calm")
    fair.charge("calm", prompt=10)
    fair.leave("calm")  # nobody active: the counters start over
    assert fair.served() == ()
    sched.fair = fair
    now[0] = RECENT_S / 2
    fair.arrive("flood")
    fair.charge("flood", prompt=500)
    flood = _seq(1, 500, "flood")
    sched.admit(flood)
    assert [(c.start, c.end) for c in sched.schedule().prefill] == [(0, 8)]
    flood.prefilled = 8
    now[0] = RECENT_S + 1.0
    assert [(c.start, c.end) for c in sched.schedule().prefill] == [(8, 8 + 256)]


def test_a_lone_short_prompt_is_not_split_while_another_tenant_was_here_a_moment_ago() -> None:
    # The drill's calm tenant asks one short question right after the flood's last request:
    # its 20 tokens take one step, not 8, 8 and 4 (passes over the weights). A longer
    # prompt, or a tenant holding several sequences, keeps the short steps.
    sched = Scheduler(max_batch=4, prefill_chunk=256, pool=BlockPool(128 + RESERVED_BLOCKS))
    fair = FairShare(clock=lambda: 0.0)
    fair.arrive("flood")
    fair.leave("flood")
    fair.arrive("calm")
    sched.fair = fair
    short = _seq(1, 20, "calm")
    sched.admit(short)
    assert [(c.start, c.end) for c in sched.schedule().prefill] == [(0, 20)]
    sched.release(short)
    long = _seq(2, 40, "calm")  # past an eighth of the budget (32)
    sched.admit(long)
    assert [(c.start, c.end) for c in sched.schedule().prefill] == [(0, 8)]
    sched.release(long)
    pair = [_seq(3, 20, "calm"), _seq(4, 20, "calm")]
    for seq in pair:
        sched.admit(seq)
    assert [(c.seq.seq_id, c.start, c.end) for c in sched.schedule().prefill] == [(3, 0, 8)]


def test_a_tenant_gone_for_good_does_not_shorten_a_lasting_floods_steps() -> None:
    # The flood never lets the node go idle, so calm keeps its counter ("served since idle");
    # that alone must not cap the flood once calm has been gone longer than RECENT_S.
    now = [0.0]
    sched = Scheduler(max_batch=4, prefill_chunk=256, pool=BlockPool(128 + RESERVED_BLOCKS))
    fair = FairShare(clock=lambda: now[0])
    sched.fair = fair
    fair.arrive("flood")
    fair.charge("flood", prompt=500)
    fair.arrive("calm")
    fair.charge("calm", prompt=10)
    fair.leave("calm")
    assert set(fair.served()) == {"flood", "calm"}
    flood = _seq(1, 500, "flood")
    sched.admit(flood)
    assert [(c.start, c.end) for c in sched.schedule().prefill] == [(0, 8)]  # calm just left
    flood.prefilled = 8
    now[0] = RECENT_S + 1.0
    assert [(c.start, c.end) for c in sched.schedule().prefill] == [(8, 8 + 256)]


def test_the_heaviest_tenant_is_preempted_even_when_older() -> None:
    engine, _ = fake_engine(max_batch=2, prefill_chunk=64, blocks=3, prefix_cache=False)
    fair = FairShare()
    engine.share_fairly(fair)
    for t in ("flood", "light"):
        fair.arrive(t)
    # each fits the pool alone (three blocks), not both together
    old, young = prompt_ids(15, 1), prompt_ids(10, 2)
    a = engine.add(old, greedy(30), chat=False, tenant="flood")
    b = engine.add(young, greedy(30), chat=False, tenant="light")
    fair.charge("flood", prompt=10_000)  # it has had far more service
    events: dict[int, list[SequenceEvent]] = {}
    seq_a, seq_b = engine.scheduler.get(a), engine.scheduler.get(b)
    assert seq_a is not None and seq_b is not None
    while not (seq_a.preemptions or seq_b.preemptions):
        for event in engine.step():
            events.setdefault(event.seq_id, []).append(event)
    # Without tenants the youngest (b) would yield; here the heavier tenant's (a) does.
    assert seq_a.preemptions == 1 and seq_b.preemptions == 0
    assert seq_a.status is SequenceStatus.PREFILLING and seq_a.blocks == []
    while engine.has_work:
        for event in engine.step():
            events.setdefault(event.seq_id, []).append(event)
    assert [t for e in events[a] for t in e.token_ids] == run_alone(old, greedy(30))
    assert [t for e in events[b] for t in e.token_ids] == run_alone(young, greedy(30))


def test_a_tenant_never_preempts_an_older_sequence_of_a_lighter_tenant() -> None:
    sched = Scheduler(max_batch=2, prefill_chunk=64, pool=BlockPool(2 + RESERVED_BLOCKS))
    fair = FairShare()
    for t in ("light", "heavy"):
        fair.arrive(t)
    fair.charge("heavy", prompt=100)
    sched.fair = fair
    old, young = _seq(1, 16, "light"), _seq(2, 15, "heavy")
    for seq in (old, young):
        sched.admit(seq)
    sched.schedule()  # one block each: the pool is empty
    for seq in (old, young):
        seq.prefilled = seq.prefill_len
        seq.status = SequenceStatus.DECODING
        seq.output_ids.append(0)
    young.output_ids.append(0)  # position 16: young needs a second block, the pool has none
    plan = sched.schedule()
    assert young in plan.preempted and old not in plan.preempted


@pytest.mark.parametrize("trial", range(12))
def test_fair_preemption_keeps_every_output_exact_and_always_progresses(trial: int) -> None:
    # Random tenants, prompts and lengths over a pool too small for all: whoever is
    # preempted, each output is exactly the prompt's alone, and the node never stalls.
    rng = random.Random(trial)
    engine, _ = fake_engine(
        max_batch=rng.choice([2, 4, 6]),
        prefill_chunk=rng.choice([8, 16, 64]),
        blocks=rng.choice([4, 5, 6, 8]),
        prefix_cache=rng.random() < 0.5,
    )
    fair = FairShare()
    engine.share_fairly(fair)
    pending = [
        (rng.choice("abc"), prompt_ids(rng.randrange(3, 30), i), rng.randrange(2, 20))
        for i in range(10)
    ]
    requests: dict[int, tuple[str, list[int], int]] = {}
    tokens: dict[int, list[int]] = {}
    for _ in range(5000):
        if not pending and not engine.has_work:
            break
        while pending and engine.can_admit(len(pending[0][1])):
            tenant, prompt, max_tokens = pending.pop(0)
            seq_id = engine.add(prompt, greedy(max_tokens), chat=False, tenant=tenant)
            fair.arrive(tenant)
            fair.charge(tenant, prompt=len(prompt))
            requests[seq_id] = (tenant, prompt, max_tokens)
        for event in engine.step():
            tenant = requests[event.seq_id][0]
            tokens.setdefault(event.seq_id, []).extend(event.token_ids)
            fair.charge(tenant, output=len(event.token_ids))
            if event.finish_reason is not None:
                fair.leave(tenant)
    assert not pending and not engine.has_work, "stalled"
    for seq_id, (_, prompt, max_tokens) in requests.items():
        assert tokens[seq_id] == run_alone(prompt, greedy(max_tokens))


def test_a_parked_sequence_frees_its_slot_and_resumes_with_the_same_tokens() -> None:
    # Parking (a lighter tenant takes the slot: request_table.py) is a preemption out of
    # max_batch: the stream pauses, then every token is the one it would have had.
    engine, _ = fake_engine(max_batch=2, prefill_chunk=64, blocks=12)
    heavy, light = prompt_ids(21, 1), prompt_ids(9, 2)
    a = engine.add(heavy, greedy(30), chat=False, tenant="flood")
    engine.add(prompt_ids(12, 3), greedy(30), chat=False, tenant="flood")
    assert not engine.park(a)  # still prefilling: nothing to park yet
    events: dict[int, list[SequenceEvent]] = {}

    def step() -> None:
        for event in engine.step():
            events.setdefault(event.seq_id, []).append(event)

    for _ in range(6):
        step()
    assert engine.free_slots == 0 and engine.park(a)
    seq_a = engine.scheduler.get(a)
    assert seq_a is not None and seq_a.blocks == [] and engine.free_slots == 1
    c = engine.add(light, greedy(5), chat=False, tenant="calm")  # the freed slot
    produced = len(events[a])
    while c not in events or events[c][-1].finish_reason is None:
        step()
        assert len(events[a]) == produced  # parked: nothing produced
    engine.resume(a)
    while engine.has_work:
        step()
    got = [t for e in events[a] for t in e.token_ids]
    assert got == run_alone(heavy, greedy(30))
    assert [e.completion_tokens for e in events[a]] == list(range(1, 31))  # no gap but time
    assert [t for e in events[c] for t in e.token_ids] == run_alone(light, greedy(5))


def test_parked_sequences_are_cancelled_like_running_ones() -> None:
    engine, _ = fake_engine(max_batch=2, prefill_chunk=64, blocks=12)
    a = engine.add(prompt_ids(9, 1), greedy(30), chat=False)
    b = engine.add(prompt_ids(9, 2), greedy(30), chat=False)
    engine.step()
    assert engine.park(a) and engine.park(b)
    engine.cancel(a)
    assert engine.scheduler.get(a) is None
    assert engine.cancel_all() == [b] and engine.scheduler.get(b) is None
    with pytest.raises(ValueError, match="not parked"):
        engine.resume(b)
