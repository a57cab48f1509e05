"""The scheduler's bookkeeping alone: slots, chunked prefill plans, release."""

from __future__ import annotations

import pytest

from neuron_trio.engine.scheduler import NoFreeSlotError, Scheduler
from neuron_trio.engine.sequence import Sequence, SequenceStatus
from neuron_trio.engine.types import SamplingParams


def _seq(seq_id: int, n_prompt: int) -> Sequence:
    return Sequence(seq_id, list(range(1, n_prompt + 1)), SamplingParams())


def test_slots_fill_then_refuse_then_free_lowest_first() -> None:
    sched = Scheduler(max_batch=3, prefill_chunk=8)
    seqs = [_seq(i, 4) for i in range(3)]
    for seq in seqs:
        sched.admit(seq)
    assert [s.slot for s in seqs] == [0, 1, 2]
    assert sched.free_slots == 0
    with pytest.raises(NoFreeSlotError):
        sched.admit(_seq(9, 4))
    sched.release(seqs[1])
    assert seqs[1].status is SequenceStatus.FINISHED
    assert sched.free_slots == 1
    late = _seq(10, 4)
    sched.admit(late)
    assert late.slot == 1
    sched.release(seqs[1])  # releasing twice is harmless
    assert sched.free_slots == 0


def test_one_prefill_chunk_per_step_oldest_first_beside_decodes() -> None:
    sched = Scheduler(max_batch=4, prefill_chunk=3)
    running = _seq(1, 2)
    sched.admit(running)
    running.status = SequenceStatus.DECODING
    long, short = _seq(2, 7), _seq(3, 2)
    sched.admit(long)
    sched.admit(short)
    spans, decodes = [], []
    for _ in range(4):
        plan = sched.schedule()
        decodes.append([s.seq_id for s in plan.decode])
        assert plan.prefill is not None
        spans.append((plan.prefill.seq.seq_id, plan.prefill.start, plan.prefill.end))
        plan.prefill.seq.prefilled = plan.prefill.end
        if plan.prefill.is_last:
            plan.prefill.seq.status = SequenceStatus.DECODING
            plan.prefill.seq.output_ids.append(0)
    assert spans == [(2, 0, 3), (2, 3, 6), (2, 6, 7), (3, 0, 2)]
    assert decodes == [[1], [1], [1], [1, 2]]  # the long prompt decodes once it is complete
    plan = sched.schedule()
    assert plan.prefill is None
    assert plan.decode == [running, long, short]


def test_release_all_empties_everything() -> None:
    sched = Scheduler(max_batch=2, prefill_chunk=4)
    a, b = _seq(1, 3), _seq(2, 3)
    sched.admit(a)
    sched.admit(b)
    assert sched.release_all() == [a, b]
    assert sched.free_slots == 2
    assert not sched.has_work
    assert sched.schedule().is_empty


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        Scheduler(max_batch=0, prefill_chunk=4)
    with pytest.raises(ValueError):
        Scheduler(max_batch=1, prefill_chunk=0)
