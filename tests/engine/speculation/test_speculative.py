"""Prompt-lookup speculation (engine/speculation/speculative.py): the proposer, and an engine with it gives
what an engine without it gives (a tiny random Llama in float32, whose output repeats some
runs of its text, so drafts are proposed, accepted and rejected), for every way a run ends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.load.loader import SingleRunner, load_transformer
from neuron_trio.engine.speculation.speculative import DraftState, Speculator, propose
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.types import Constraint, SamplingParams, SequenceEvent
from tests.engine.speculation.spec_runs import run_prompts, text_of, tokens_of
from tests.engine.tiny_gguf import write_tiny_llama

PROMPTS = [
    "the cat sat on the mat, the cat sat on the mat, the cat",
    "one two three four one two three four one two",
    "in the beginning",
    "abc abc abc abc abc abc",
    "there is an answer and here it is, there is an answer",
    "hello world",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _soften(weights: dict[str, np.ndarray]) -> None:
    weights["output.weight"] *= 0.5  # flatter logits: sampled drafts are often rejected


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # untied: a tied random model repeats its last token forever; this one wanders, repeating
    # some runs, so greedy drafts are both accepted and rejected
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return write_tiny_llama(path, seed=3, tied=False, edit_weights=_soften)


@pytest.fixture(scope="module")
def sharp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # tied: sharply peaked on repeating its last token, so that sampled drafts are accepted
    # (at a high temperature, not always)
    return write_tiny_llama(tmp_path_factory.mktemp("sharp") / "sharp.gguf", seed=3)


def _engine(path: Path, k: int = 0, *, max_batch: int = 8, blocks: int = 0) -> Engine:
    if not blocks:
        engine = Engine.from_gguf(
            path, dtype="float32", max_batch=max_batch, context=128, speculative_tokens=k
        )
    else:
        with GGUFFile(path) as gguf:  # a small pool: sequences are preempted
            model = load_transformer(gguf, dtype="float32", device=torch.device("cpu"))
            tokenizer = Tokenizer.from_gguf(gguf)
        runner = SingleRunner(model, blocks=blocks, context=128)
        engine = Engine(runner, tokenizer, max_batch=max_batch, context=128, speculative_tokens=k)
    if engine.speculator is not None:
        engine.speculator.max_rows = max_batch  # drafts however many rows decode together
    return engine


def _accepted(engine: Engine) -> int:
    assert engine.speculator is not None
    return engine.speculator.counts.accepted


# ---- the proposer ---------------------------------------------------------------------------


def test_propose_takes_the_newest_occurrence_of_the_longest_suffix() -> None:
    tokens = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3], dtype=np.int64)
    # suffix [2, 3] occurred at 1..2 (then 9) and at 5..6 (then 7): the newest wins
    assert propose(tokens, 3) == [7, 8, 5]
    # the longest suffix wins over a newer shorter one: [5, 2, 3]... only [2, 3] matches here;
    tokens = np.array([4, 2, 3, 6, 1, 3, 7, 4, 2, 3], dtype=np.int64)
    # [4, 2, 3] occurred at 0..2 (then 6); [3] alone occurs newer at 5 (then 7)
    assert propose(tokens, 2) == [6, 1]


def test_propose_nothing_without_an_earlier_occurrence() -> None:
    assert propose(np.array([1, 2, 3, 4], dtype=np.int64), 4) == []
    assert propose(np.array([5], dtype=np.int64), 4) == []
    assert propose(np.array([5, 5], dtype=np.int64), 0) == []
    # a match at the very end has one token after it at most
    assert propose(np.array([7, 5, 5], dtype=np.int64), 4) == [5]


def test_draft_state_adapts_k_and_cools_down() -> None:
    state = DraftState(k=4)
    state.record(4, 4, most=6)
    assert state.k == 5
    state.record(5, 1, most=6)
    assert state.k == 2
    for _ in range(5):
        state.record(2, 0, most=6)
    assert state.cool > 0 and state.k == 1


def test_num_tokens_is_bounded() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        Speculator(0)
    with pytest.raises(ValueError, match="num_tokens"):
        Speculator(17)


# ---- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_is_the_same_with_speculation(tiny_path: Path, k: int) -> None:
    plain = [tokens_of(e) for e in run_prompts(_engine(tiny_path), PROMPTS, GREEDY)]
    spec_engine = _engine(tiny_path, k)
    # one at a time (batch 1) and all together (speculating and plain rows in one step)
    alone = [tokens_of(run_prompts(spec_engine, [p], GREEDY)[0]) for p in PROMPTS]
    together = [tokens_of(e) for e in run_prompts(spec_engine, PROMPTS, GREEDY)]
    assert alone == plain
    assert together == plain
    assert _accepted(spec_engine) > 0  # drafts were proposed and kept


def test_max_tokens_cuts_inside_an_accepted_run(tiny_path: Path) -> None:
    plain_engine, spec_engine = _engine(tiny_path), _engine(tiny_path, 8)
    for max_tokens in range(1, 24):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        plain = run_prompts(plain_engine, PROMPTS[:2], params)
        spec = run_prompts(spec_engine, PROMPTS[:2], params)
        assert [tokens_of(e) for e in spec] == [tokens_of(e) for e in plain], max_tokens
        assert all(len(tokens_of(e)) == max_tokens for e in spec)
        assert all(e[-1].finish_reason == "length" for e in spec)
    assert _accepted(spec_engine) > 0


def test_stop_strings_cut_inside_an_accepted_run(tiny_path: Path) -> None:
    plain_engine, spec_engine = _engine(tiny_path), _engine(tiny_path, 8)
    prompts = PROMPTS[2:3]  # "in the beginning": its answer repeats runs of tokens
    full = text_of(run_prompts(plain_engine, prompts, GREEDY)[0])
    assert len(full) > 30
    for cut in (5, 11, 17, 23, 29):
        stop = full[cut : cut + 2]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=(stop,))
        plain = run_prompts(plain_engine, prompts, params)[0]
        spec = run_prompts(spec_engine, prompts, params)[0]
        assert text_of(spec) == text_of(plain), stop
        assert spec[-1].finish_reason == plain[-1].finish_reason == "stop"
        assert stop not in text_of(spec)
    assert _accepted(spec_engine) > 0


def test_logprobs_and_penalties_are_those_without_speculation(tiny_path: Path) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    penalised = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, frequency_penalty=0.3
    )
    for p in (params, penalised):
        plain_engine, spec_engine = _engine(tiny_path), _engine(tiny_path, 6)
        plain = run_prompts(plain_engine, PROMPTS, p)
        spec = run_prompts(spec_engine, PROMPTS, p)
        assert [tokens_of(e) for e in spec] == [tokens_of(e) for e in plain]
        assert spec_engine.speculator is not None
        # (penalties make repeats rare: drafts are verified, seldom kept)
        assert _accepted(spec_engine) if p.logprobs else spec_engine.speculator.counts.proposed
        if p.logprobs:
            for a, b in zip(plain, spec, strict=True):
                la = [x for e in a for x in e.logprobs or ()]
                lb = [x for e in b for x in e.logprobs or ()]
                assert len(la) == len(lb) == 30
                for x, y in zip(la, lb, strict=True):
                    assert x.token_id == y.token_id
                    assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                    assert [t for t, _, _ in x.top] == [t for t, _, _ in y.top]


def test_seeded_choices_are_those_without_speculation(sharp_path: Path) -> None:
    # each token takes one draw of the sequence's generator with or without speculation
    params = SamplingParams(temperature=3.0, max_tokens=30, ignore_eos=True, seed=11, n=3)
    plain = run_prompts(_engine(sharp_path), PROMPTS[:2], params)
    spec_engine = _engine(sharp_path, 4)
    spec = run_prompts(spec_engine, PROMPTS[:2], params)

    def by_choice(events: list[SequenceEvent]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for e in events:
            out.setdefault(e.index, []).extend(e.token_ids)
        return out

    assert [by_choice(e) for e in spec] == [by_choice(e) for e in plain]
    assert _accepted(spec_engine) > 0


def test_preempted_sequences_give_the_same_tokens(tiny_path: Path) -> None:
    # 12 blocks for 4 sequences of up to ~60 tokens: they preempt one another
    plain_engine = _engine(tiny_path, max_batch=4, blocks=12)
    spec_engine = _engine(tiny_path, 4, max_batch=4, blocks=12)
    plain = [tokens_of(e) for e in run_prompts(plain_engine, PROMPTS[:4], GREEDY)]
    spec = [tokens_of(e) for e in run_prompts(spec_engine, PROMPTS[:4], GREEDY)]
    assert spec == plain
    assert spec_engine.scheduler.preemptions > 0
    assert _accepted(spec_engine) > 0
    assert spec_engine.pool.statistics().used == 0  # every block came back


def test_a_constrained_sequence_is_not_speculated(tiny_path: Path) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=20, constraint=Constraint("json", '{"type":"object"}')
    )
    plain = run_prompts(_engine(tiny_path), PROMPTS[:1], params)[0]
    spec_engine = _engine(tiny_path, 4)
    spec = run_prompts(spec_engine, PROMPTS[:1], params)[0]
    assert tokens_of(spec) == tokens_of(plain)
    assert spec_engine.speculator is not None
    assert spec_engine.speculator.counts.proposed == 0


def test_no_drafts_while_more_rows_decode_than_max_rows(tiny_path: Path) -> None:
    engine = _engine(tiny_path, 4)
    assert engine.speculator is not None
    engine.speculator.max_rows = 3
    run_prompts(engine, PROMPTS[:4], GREEDY)
    assert engine.speculator.counts.proposed == 0


def test_blocks_past_a_rejected_draft_go_back(sharp_path: Path) -> None:
    engine = _engine(sharp_path, 16)
    sampled = SamplingParams(temperature=3.0, max_tokens=40, ignore_eos=True, seed=5)
    for prompt in PROMPTS:  # sampled: some drafts are rejected
        engine.add(engine.encode_prompt(prompt, chat=False), sampled, chat=False)
    while engine.has_work:
        engine.step()
        for seq in engine.scheduler.sequences:
            if seq.num_output:
                # after every step: blocks for its positions and the next one at most
                assert len(seq.blocks) <= -(-(seq.decode_pos + 1) // 16)
    assert engine.pool.statistics().used == 0
    counts = engine.speculator.counts if engine.speculator is not None else None
    assert counts is not None and 0 < counts.accepted < counts.proposed  # some were rejected
