"""Continuous batching, the scheduler alone and through the engine on a tiny model: admission,
chunked prefill, cancellation, stops, the prefix cache, preemption."""

from __future__ import annotations

from dataclasses import replace

import pytest

from neuron_trio.engine.block_pool import (
    BLOCK_TOKENS,
    PROBE_BLOCK,
    RESERVED_BLOCKS,
    BlockPool,
)
from neuron_trio.engine.scheduler import NoFreeSlotError, Scheduler
from neuron_trio.engine.sequence import Sequence, SequenceStatus
from neuron_trio.engine.types import SamplingParams, SequenceEvent
from neuron_trio.errors import ContextLengthError, RequestError
from tests.engine.drain import drain
from tests.engine.fake_runner import (
    BOS,
    END,
    EOS,
    GREEDY,
    TOKEN,
    VOCAB,
    fake_engine,
    greedy,
    prompt_ids,
    run_alone,
)


def _seq(seq_id: int, n_prompt: int) -> Sequence:
    return Sequence(seq_id, list(range(1, n_prompt + 1)), SamplingParams())


def _scheduler(max_batch: int, prefill_chunk: int, blocks: int = 64) -> Scheduler:
    return Scheduler(
        max_batch=max_batch, prefill_chunk=prefill_chunk, pool=BlockPool(blocks + RESERVED_BLOCKS)
    )


def test_max_batch_limits_admission_and_blocks_go_lowest_first() -> None:
    sched = _scheduler(3, 12)
    seqs = [_seq(i, 4) for i in range(3)]
    for seq in seqs:
        sched.admit(seq)
    assert sched.free_slots == 0
    with pytest.raises(NoFreeSlotError):
        sched.admit(_seq(9, 4))
    sched.schedule()
    assert [s.blocks for s in seqs] == [[2], [3], [4]]  # the lowest free block first
    sched.release(seqs[1])
    assert seqs[1].status is SequenceStatus.FINISHED and seqs[1].blocks == []
    assert sched.free_slots == 1
    late = _seq(10, 4)
    sched.admit(late)
    sched.schedule()
    assert late.blocks == [3]
    sched.release(seqs[1])  # releasing twice is harmless
    assert sched.free_slots == 0


def _plan_spans(sched: Scheduler) -> list[tuple[int, int, int]]:
    """One step's prefill chunks as (seq_id, start, end), then advanced as the engine would."""
    plan = sched.schedule()
    for chunk in plan.prefill:
        chunk.seq.prefilled = chunk.end
        if chunk.is_last:
            chunk.seq.status = SequenceStatus.DECODING
            chunk.seq.output_ids.append(0)
    return [(c.seq.seq_id, c.start, c.end) for c in plan.prefill]


def test_a_long_prompt_is_chunked_oldest_first_beside_decodes() -> None:
    sched = _scheduler(4, 3)
    running = _seq(1, 2)
    sched.admit(running)
    running.status = SequenceStatus.DECODING
    long, short = _seq(2, 7), _seq(3, 2)
    sched.admit(long)
    sched.admit(short)
    spans, decodes = [], []
    for _ in range(4):
        decodes.append([s.seq_id for s in sched.schedule().decode])
        spans.append(_plan_spans(sched))
    # The long prompt fills the budget alone; its last token leaves room for one of short's
    # (rows × longest row <= 3).
    assert spans == [[(2, 0, 3)], [(2, 3, 6)], [(2, 6, 7), (3, 0, 1)], [(3, 1, 2)]]
    assert decodes == [[1], [1], [1], [1, 2]]  # the long prompt decodes once it is complete
    plan = sched.schedule()
    assert plan.prefill == []
    assert plan.decode == [running, long, short]


def test_prompts_that_arrive_together_are_prefilled_together_within_the_budget() -> None:
    sched = _scheduler(8, 16)
    seqs = [_seq(i, n) for i, n in enumerate([3, 4, 2, 5, 3, 9, 1], start=1)]
    for seq in seqs:
        sched.admit(seq)
    steps = []
    while sched.count(SequenceStatus.PREFILLING):
        plan = sched.schedule()
        width = max(c.end - c.start for c in plan.prefill)
        assert len(plan.prefill) * width <= 16  # padding included
        ids = [c.seq.seq_id for c in plan.prefill]
        assert ids == sorted(ids)  # oldest first
        steps.append(_plan_spans(sched))
    assert steps == [
        # 4 rows of at most 16 // 4 = 4 tokens: the 5-token prompt gets its first 4
        [(1, 0, 3), (2, 0, 4), (3, 0, 2), (4, 0, 4)],
        # the 9-token prompt gets 16 // 3 = 5; then the last one would need 4 rows of 5: waits
        [(4, 4, 5), (5, 0, 3), (6, 0, 5)],
        [(6, 5, 9), (7, 0, 1)],
    ]
    assert all(s.status is SequenceStatus.DECODING for s in seqs)


def test_release_all_empties_everything() -> None:
    sched = _scheduler(2, 4)
    a, b = _seq(1, 3), _seq(2, 3)
    sched.admit(a)
    sched.admit(b)
    assert sched.release_all() == [a, b]
    assert sched.free_slots == 2
    assert not sched.has_work
    assert sched.schedule().is_empty


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        _scheduler(0, 4)
    with pytest.raises(ValueError):
        _scheduler(1, 0)


def test_slots_fill_and_free_through_the_engine() -> None:
    engine, _ = fake_engine(max_batch=2)
    a = engine.add(prompt_ids(3), GREEDY, chat=False)
    engine.add(prompt_ids(3, 1), GREEDY, chat=False)
    assert engine.free_slots == 0
    with pytest.raises(NoFreeSlotError):
        engine.add(prompt_ids(3, 2), GREEDY, chat=False)
    engine.cancel(a)
    assert engine.free_slots == 1
    engine.add(prompt_ids(3, 2), GREEDY, chat=False)
    drain(engine)
    assert engine.free_slots == 2
    assert not engine.has_work


def test_chunked_prefill_interleaves_with_decode_and_matches_alone() -> None:
    engine, runner = fake_engine(prefill_chunk=4)
    short, long = prompt_ids(3, 1), prompt_ids(13, 2)
    first = engine.add(short, GREEDY, chat=False)
    engine.step()  # short prompt in, first token out
    second = engine.add(long, GREEDY, chat=False)
    runner.calls.clear()
    steps = []
    while engine.statistics().prefilling:
        steps.append({e.seq_id for e in engine.step()})
    # 13 prompt tokens in chunks of 4: four steps, each also decoding the running sequence
    assert runner.calls == [(1, 1), (1, 4)] * 3 + [(1, 1), (1, 1)]
    assert steps == [{first}, {first}, {first}, {first, second}]
    events = drain(engine)
    assert [t for e in events[second] for t in e.token_ids][-7:] == run_alone(long, GREEDY)[1:]
    assert len(run_alone(short, GREEDY)) == 8


def test_batched_equals_alone_with_joins_and_leaves() -> None:
    engine, _ = fake_engine(max_batch=4, prefill_chunk=3)
    prompts = [prompt_ids(2 + 3 * i, i) for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(6)
    ]
    ids: dict[int, int] = {}
    pending = list(range(6))
    tokens: dict[int, list[int]] = {}
    while pending or engine.has_work:
        while pending and engine.free_slots:
            i = pending.pop(0)
            ids[engine.add(prompts[i], params[i], chat=False)] = i
        for event in engine.step():
            tokens.setdefault(ids[event.seq_id], []).extend(event.token_ids)
    for i in range(6):
        assert tokens[i] == run_alone(prompts[i], params[i]), i


def test_cancel_between_any_two_steps_frees_the_slot() -> None:
    for cancel_after in range(6):
        engine, _ = fake_engine(max_batch=1, prefill_chunk=2)
        seq_id = engine.add(prompt_ids(5), GREEDY, chat=False)
        for _ in range(cancel_after):
            engine.step()
        engine.cancel(seq_id)
        assert engine.free_slots == 1
        assert not engine.has_work
        assert engine.step() == []
        # the slot is reusable and the new sequence is unaffected by the old one
        again = engine.add(prompt_ids(4, 3), GREEDY, chat=False)
        got = [t for e in drain(engine)[again] for t in e.token_ids]
        assert got == run_alone(prompt_ids(4, 3), GREEDY)
    engine.cancel(12345)  # unknown: ignored


def test_cancel_all_drops_everything() -> None:
    engine, _ = fake_engine(max_batch=3)
    ids = [engine.add(prompt_ids(4, i), GREEDY, chat=False) for i in range(3)]
    engine.step()
    assert sorted(engine.cancel_all()) == ids
    assert engine.free_slots == 3
    assert engine.statistics().slots_in_use == 0


def test_a_failed_forward_advances_nothing() -> None:
    engine, runner = fake_engine(prefill_chunk=2)
    seq_id = engine.add(prompt_ids(5), GREEDY, chat=False)
    engine.step()
    runner.fail_next = True
    with pytest.raises(RuntimeError):
        engine.step()
    got = [t for e in drain(engine)[seq_id] for t in e.token_ids]
    assert got == run_alone(prompt_ids(5), GREEDY)


def test_validation_refuses_before_any_work() -> None:
    engine, runner = fake_engine(context=16)
    with pytest.raises(ContextLengthError):
        engine.add(prompt_ids(10), SamplingParams(max_tokens=7), chat=False)
    engine.prepare(SamplingParams(max_tokens=6), ids=prompt_ids(10))
    with pytest.raises(RequestError):
        engine.add([], GREEDY, chat=False)
    with pytest.raises(RequestError):
        engine.add([BOS, VOCAB], GREEDY, chat=False)
    with pytest.raises(RequestError):
        engine.add([BOS, -1], GREEDY, chat=False)
    assert runner.calls == []
    assert engine.free_slots == 4


def test_kv_never_grows_past_context() -> None:
    engine, runner = fake_engine(max_batch=2, context=12, prefill_chunk=5)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a = engine.add(prompt_ids(8), params, chat=False)
    b = engine.add(prompt_ids(8, 1), params, chat=False)
    events = drain(engine)
    assert [e.finish_reason for e in events[a]][-1] == "length"
    assert sum(len(e.token_ids) for e in events[b]) == 4
    assert runner.longest == 11  # 8 + 3 fed back (the 4th is not); FakeRunner checks 12


def _scripted(prompt_len: int, script: list[int]):
    return lambda row: script[min(len(row) - prompt_len, len(script) - 1)]


def test_length_finish_and_usage_counts() -> None:
    engine, _ = fake_engine()
    seq_id = engine.add(prompt_ids(5), SamplingParams(temperature=0.0, max_tokens=3), chat=False)
    events = drain(engine)[seq_id]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert [(e.prompt_tokens, e.completion_tokens) for e in events] == [(5, 1), (5, 2), (5, 3)]
    stats = engine.statistics()
    assert (stats.prompt_tokens_total, stats.generated_tokens_total) == (5, 3)
    assert stats.steps == 4  # two prefill chunks, then two decodes


def test_eos_stops_unless_ignored_and_is_not_shown() -> None:
    words = [TOKEN[" the"], TOKEN[" cat"], EOS, TOKEN[" sat"]]
    engine, _ = fake_engine(rule=_scripted(3, words))
    seq_id = engine.add(prompt_ids(3), SamplingParams(temperature=0.0, max_tokens=8), chat=False)
    events = drain(engine)[seq_id]
    assert "".join(e.text for e in events) == " the cat"
    assert events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == 3

    engine, _ = fake_engine(rule=_scripted(3, words))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    seq_id = engine.add(prompt_ids(3), params, chat=False)
    events = drain(engine)[seq_id]
    assert "".join(e.text for e in events) == " the cat sat sat"
    assert events[-1].finish_reason == "length"


def test_end_of_turn_stops_chat_only_and_stop_token_ids_always() -> None:
    words = [TOKEN[" the"], END, TOKEN[" cat"]]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for chat, reason, count in ((True, "stop", 2), (False, "length", 4)):
        engine, _ = fake_engine(rule=_scripted(3, words))
        seq_id = engine.add(prompt_ids(3), params, chat=chat)
        events = drain(engine)[seq_id]
        assert (events[-1].finish_reason, events[-1].completion_tokens) == (reason, count)
    engine, _ = fake_engine(rule=_scripted(3, words))
    stop_at_cat = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(TOKEN[" cat"],))
    seq_id = engine.add(prompt_ids(3), stop_at_cat, chat=False)
    events = drain(engine)[seq_id]
    assert events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == 3


def test_stop_string_across_tokens_is_cut_exactly() -> None:
    words = [TOKEN[" the"], TOKEN["ST"], TOKEN["OP"], TOKEN[" cat"]]
    engine, _ = fake_engine(rule=_scripted(3, words))
    params = SamplingParams(temperature=0.0, max_tokens=8, stop=("eSTO",))
    seq_id = engine.add(prompt_ids(3), params, chat=False)
    events = drain(engine)[seq_id]
    assert "".join(e.text for e in events) == " th"
    assert events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == 3
    assert engine.free_slots == 4


def test_never_half_a_utf8_character() -> None:
    words = [TOKEN["!"], TOKEN["\xc3"], TOKEN["\xa9"], TOKEN["!"]]
    engine, _ = fake_engine(rule=_scripted(3, words))
    seq_id = engine.add(prompt_ids(3), SamplingParams(temperature=0.0, max_tokens=4), chat=False)
    texts = [e.text for e in drain(engine)[seq_id]]
    assert texts == ["!", "", "é", "!"]


def test_logprobs_ride_on_events() -> None:
    engine, _ = fake_engine()
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=True, top_logprobs=2)
    seq_id = engine.add(prompt_ids(3), params, chat=False)
    events = drain(engine)[seq_id]
    for event in events:
        assert event.logprobs is not None and len(event.logprobs) == 1
        assert event.logprobs[0].token_id == event.token_ids[0]
        assert len(event.logprobs[0].top) == 2


def test_probe_uses_the_scratch_row_only() -> None:
    engine, runner = fake_engine(max_batch=2)
    seq_id = engine.add(prompt_ids(3), GREEDY, chat=False)
    engine.step()
    engine.probe()
    assert runner.store[PROBE_BLOCK][:2] == [BOS, None]  # its own block, nothing else
    got = [t for e in drain(engine)[seq_id] for t in e.token_ids]
    assert got == run_alone(prompt_ids(3), GREEDY)[1:]


def test_encode_prompt_adds_bos_once() -> None:
    engine, _ = fake_engine()
    assert engine.encode_prompt("the cat", chat=False) == [BOS, TOKEN[" the"], TOKEN[" cat"]]


def test_a_step_in_flight_during_cancel_all_is_void() -> None:
    engine, runner = fake_engine(max_batch=2, prefill_chunk=8)
    engine.add(prompt_ids(3), GREEDY, chat=False)
    engine.step()
    inner = runner.forward

    def wedged_then_back(*args, **kwargs):
        engine.cancel_all()  # the watchdog gave up on this step meanwhile
        return inner(*args, **kwargs)

    runner.forward = wedged_then_back  # type: ignore[method-assign]
    assert engine.step() == []
    runner.forward = inner  # type: ignore[method-assign]
    assert engine.free_slots == 2
    seq_id = engine.add(prompt_ids(4, 1), GREEDY, chat=False)
    assert [t for e in drain(engine)[seq_id] for t in e.token_ids] == run_alone(
        prompt_ids(4, 1), GREEDY
    )


def test_text_held_back_for_a_stop_string_comes_out_at_the_end() -> None:
    words = [TOKEN[" the"], TOKEN[" cat"]]
    engine, _ = fake_engine(rule=_scripted(3, words))
    params = SamplingParams(temperature=0.0, max_tokens=2, stop=(" catX",))
    seq_id = engine.add(prompt_ids(3), params, chat=False)
    events = drain(engine)[seq_id]
    assert [e.text for e in events] == [" the", " cat"]
    assert events[-1].finish_reason == "length"


# ---- the paged KV cache: prefix reuse, preemption, forks in a small pool ----------------------


def test_a_repeated_prompt_prefills_only_past_its_cached_prefix() -> None:
    engine, runner = fake_engine(prefill_chunk=64)
    system = prompt_ids(40, 7)  # two full blocks and 8 tokens
    first = system + [TOKEN[" cat"]] * 5
    a = engine.add(first, greedy(4), chat=False)
    got_a = [t for e in drain(engine)[a] for t in e.token_ids]
    runner.calls.clear()
    second = system + [TOKEN[" mat"]] * 9  # the same system prompt, another question
    b = engine.add(second, greedy(4), chat=False)
    got_b = [t for e in drain(engine)[b] for t in e.token_ids]
    # the first two blocks came from the cache: 49 - 32 = 17 tokens prefilled, not 49
    assert runner.calls[0] == (1, len(second) - 2 * BLOCK_TOKENS)
    stats = engine.statistics()
    assert stats.prefix_cache_queries_tokens == len(first) + len(second)
    assert stats.prefix_cache_hits_tokens == 2 * BLOCK_TOKENS
    assert stats.prompt_tokens_total == len(first) + len(second) - 2 * BLOCK_TOKENS
    # and the outputs are those of each prompt alone on a fresh engine
    assert got_a == run_alone(first, greedy(4))
    assert got_b == run_alone(second, greedy(4))


def test_a_chat_turn_reuses_the_previous_answer_and_never_its_own_last_token() -> None:
    engine, runner = fake_engine(prefill_chunk=64)
    prompt = prompt_ids(30, 3)
    a = engine.add(prompt, greedy(20), chat=False)
    answer = [t for e in drain(engine)[a] for t in e.token_ids]
    # The next turn resends prompt + answer: blocks filled while decoding were cached too.
    turn = prompt + answer + [TOKEN[" the"]]  # 51 tokens: three full blocks
    runner.calls.clear()
    b = engine.add(turn, greedy(3), chat=False)
    got = [t for e in drain(engine)[b] for t in e.token_ids]
    assert runner.calls[0] == (1, len(turn) - 3 * BLOCK_TOKENS)
    assert got == run_alone(turn, greedy(3))
    # A prompt of whole blocks only, all cached: its last block is computed again (logits).
    whole = turn[: 3 * BLOCK_TOKENS]
    runner.calls.clear()
    c = engine.add(whole, greedy(2), chat=False)
    assert [t for e in drain(engine)[c] for t in e.token_ids] == run_alone(whole, greedy(2))
    assert runner.calls[0] == (1, BLOCK_TOKENS)


def test_without_the_prefix_cache_every_prompt_is_computed() -> None:
    engine, runner = fake_engine(prefill_chunk=64, prefix_cache=False)
    prompt = prompt_ids(40, 7)
    for _ in range(2):
        runner.calls.clear()
        seq = engine.add(prompt, greedy(3), chat=False)
        assert [t for e in drain(engine)[seq] for t in e.token_ids] == run_alone(prompt, greedy(3))
        assert runner.calls[0] == (1, 40)
    stats = engine.statistics()
    assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (0, 0)
    assert stats.kv_blocks_cached == 0


def test_two_requests_share_the_blocks_of_a_cached_prefix() -> None:
    engine, _ = fake_engine(prefill_chunk=64)
    system = prompt_ids(32, 9)
    warm = engine.add([*system, 5], greedy(1), chat=False)
    drain(engine)
    assert warm and engine.statistics().kv_blocks_cached == 2
    a = engine.add([*system, 6, 7], greedy(6), chat=False)
    b = engine.add([*system, 8], greedy(6), chat=False)
    first = {e.seq_id: e.token_ids for e in engine.step()}  # both prefilled
    seq_a, seq_b = engine.scheduler.get(a), engine.scheduler.get(b)
    assert seq_a is not None and seq_b is not None
    assert seq_a.blocks[:2] == seq_b.blocks[:2]  # one copy of the system prompt
    assert seq_a.blocks[2] != seq_b.blocks[2]
    assert engine.statistics().kv_blocks_used == 4
    events = drain(engine)
    got_a = first[a] + [t for e in events[a] for t in e.token_ids]
    assert got_a == run_alone([*system, 6, 7], greedy(6))
    got_b = first[b] + [t for e in events[b] for t in e.token_ids]
    assert got_b == run_alone([*system, 8], greedy(6))


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_an_exhausted_pool_preempts_the_youngest_and_every_output_is_unchanged(
    prefix_cache: bool,
) -> None:
    # 6 blocks (96 tokens) for three sequences that grow to 40 tokens (3 blocks) each.
    engine, _ = fake_engine(max_batch=3, prefill_chunk=16, blocks=6, prefix_cache=prefix_cache)
    prompts = [prompt_ids(14 + i, 20 + i) for i in range(3)]
    params = greedy(26 - 1)
    ids = [engine.add(p, params, chat=False) for p in prompts]
    preempted_seen: set[int] = set()
    events: dict[int, list[SequenceEvent]] = {}
    while engine.has_work:
        for event in engine.step():
            events.setdefault(event.seq_id, []).append(event)
        stats = engine.statistics()
        assert stats.kv_blocks_used <= 6
        preempted_seen |= {s.seq_id for s in engine.scheduler.sequences if s.preemptions}
    assert engine.statistics().preemptions >= 1
    assert ids[0] not in preempted_seen  # the oldest always progresses
    for seq_id, prompt in zip(ids, prompts, strict=True):
        tokens = [t for e in events[seq_id] for t in e.token_ids]
        # no token lost or repeated: exactly the output of the prompt alone
        assert tokens == run_alone(prompt, params), seq_id
        assert [e.completion_tokens for e in events[seq_id]] == list(range(1, 26))
        assert events[seq_id][-1].finish_reason == "length"


def test_a_preempted_sequence_resumes_without_sampling_again() -> None:
    engine, runner = fake_engine(max_batch=2, prefill_chunk=64, blocks=3, prefix_cache=False)
    # each fits the pool alone (three blocks), not both together
    old, young = prompt_ids(15, 1), prompt_ids(10, 2)
    a = engine.add(old, greedy(30), chat=False)
    b = engine.add(young, greedy(30), chat=False)
    events: dict[int, list[SequenceEvent]] = {}

    def step() -> None:
        for event in engine.step():
            events.setdefault(event.seq_id, []).append(event)

    step()  # both prefilled: a holds one block, b one
    seq_b = engine.scheduler.get(b)
    assert seq_b is not None
    while seq_b.preemptions == 0:  # a takes the last block at position 16; b needs one next
        assert seq_b.num_output < 10
        step()
    assert seq_b.status is SequenceStatus.PREFILLING and seq_b.blocks == []
    produced = seq_b.num_output
    assert produced == 16 - len(young) + 1  # it fed position 15 and sampled: then it stopped
    while seq_b.status is SequenceStatus.PREFILLING:  # it waits until a no longer needs them
        step()
        assert len(events[b]) == produced
    while engine.has_work:
        step()
    got_b = [t for e in events[b] for t in e.token_ids]
    assert got_b == run_alone(young, greedy(30))
    # the client saw a pause, not a token lost or repeated
    assert [e.completion_tokens for e in events[b]] == list(range(1, 31))
    assert [t for e in events[a] for t in e.token_ids] == run_alone(old, greedy(30))
    assert runner.longest == 15 + 29


def test_a_request_that_cannot_fit_the_pool_alone_is_refused_up_front() -> None:
    engine, runner = fake_engine(context=64, blocks=2)
    engine.prepare(greedy(12), ids=prompt_ids(20))  # 32 tokens: two blocks
    with pytest.raises(ContextLengthError, match=r"KV cache .* holds 32 tokens"):
        engine.add(prompt_ids(20), greedy(13), chat=False)
    assert runner.calls == []


def test_admission_waits_for_the_blocks_of_the_prompt() -> None:
    engine, _ = fake_engine(max_batch=4, blocks=4, prefill_chunk=64)
    assert engine.can_admit(64) and not engine.can_admit(65)
    assert not engine.can_admit(1, n=5)  # more choices than max_batch
    a = engine.add(prompt_ids(40), greedy(8), chat=False)
    engine.step()  # its 40 tokens take three blocks
    assert engine.can_admit(16) and not engine.can_admit(17)
    assert not engine.can_admit(16, n=2)  # two choices need a block each for their last block
    engine.cancel(a)
    assert engine.can_admit(64)


def test_n_choices_in_a_full_pool_recompute_their_partial_block() -> None:
    # The prompt fills one block and 4 tokens; nothing is left for the forks' copies of the
    # partial block, so they prefill those 4 tokens themselves (shared full block kept).
    engine, _ = fake_engine(max_batch=3, prefill_chunk=64, blocks=2)
    prompt = prompt_ids(20, 4)
    params = replace(greedy(8), n=3)
    group = engine.add(prompt, params, chat=False)
    first = engine.step()
    forks = [s for s in engine.scheduler.sequences if s.seq_id != group]
    parent = engine.scheduler.get(group)
    assert parent is not None
    for fork in forks:
        assert fork.blocks == parent.blocks[:1]  # shared; the rest is theirs to recompute
        assert fork.status is SequenceStatus.PREFILLING and fork.num_output == 1
    events = first + drain(engine)[group]
    alone = run_alone(prompt, greedy(8))
    by_choice: dict[int, list[int]] = {}
    for e in events:
        by_choice.setdefault(e.index, []).extend(e.token_ids)
    assert by_choice == {0: alone, 1: alone, 2: alone}


def test_cancel_all_forgets_the_prefix_cache() -> None:
    engine, runner = fake_engine(prefill_chunk=64)
    prompt = prompt_ids(40, 7)
    engine.add(prompt, greedy(2), chat=False)
    drain(engine)
    assert engine.statistics().kv_blocks_cached == 2
    engine.add(prompt, greedy(2), chat=False)
    engine.cancel_all()
    stats = engine.statistics()
    assert (stats.kv_blocks_used, stats.kv_blocks_cached) == (0, 0)
    runner.calls.clear()
    seq = engine.add(prompt, greedy(2), chat=False)
    assert [t for e in drain(engine)[seq] for t in e.token_ids] == run_alone(prompt, greedy(2))
    assert runner.calls[0] == (1, 40)
