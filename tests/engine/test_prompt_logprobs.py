"""A prompt's own logprobs (`SamplingParams.prompt_logprobs`) on the built-in model, against
Hugging Face transformers in float32: every position, over several prefill chunks, with a
cached prefix present, for every choice of n (slow: loads the model twice); and a prefill
computed again (after a preemption) appends nothing twice."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.prompt_logprobs import collect_prompt_logprobs, start_prompt_logprobs
from neuron_trio.engine.sequence import Sequence
from neuron_trio.engine.types import SamplingParams, SequenceEvent, TokenLogprob
from tests.engine.drain import drain
from tests.engine.hf_reference import load_hf_reference

TEXT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
TOLERANCE = 1e-3  # float32 both sides; logprobs are differences of logits of scale ~20


def test_a_prefill_computed_again_appends_nothing_twice() -> None:
    seq = Sequence(1, [5, 6, 7, 8, 9], SamplingParams(top_logprobs=1, prompt_logprobs=True))
    start_prompt_logprobs(seq, str)
    vocab = 10
    rows = torch.log_softmax(torch.arange(5 * vocab, dtype=torch.float32).view(5, vocab), -1)
    collect_prompt_logprobs(seq, 0, rows[:3], str)  # positions 0..2: tokens 1..3
    assert [lp.token_id for lp in seq.prompt_logprobs or ()] == [5, 6, 7, 8]
    assert seq.collects_prompt_logprobs
    collect_prompt_logprobs(seq, 0, rows[:3], str)  # the same chunk again: nothing new
    collect_prompt_logprobs(seq, 3, rows[3:5], str)  # the last position predicts no prompt
    got = seq.prompt_logprobs or []
    assert [lp.token_id for lp in got] == [5, 6, 7, 8, 9]
    assert not seq.collects_prompt_logprobs
    assert got[4].logprob == pytest.approx(rows[3, 9].item())
    assert [t for t, _, _ in got[4].top] == [9]


@pytest.fixture(scope="module")
def reference() -> Iterator[tuple[Any, Engine]]:
    hf, _tok, path = load_hf_reference()
    # prefill_chunk 8: the prompt spans several chunks (and steps)
    engine = Engine.from_gguf(path, dtype="float32", max_batch=4, context=256, prefill_chunk=8)
    yield hf, engine


def _want(hf: Any, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row p is the distribution of token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _first(events: list[SequenceEvent], index: int = 0) -> list[TokenLogprob]:
    got = [e for e in events if e.index == index and e.prompt_logprobs is not None]
    assert len(got) == 1, "the prompt's logprobs come once per choice, with its first token"
    assert got[0].token_ids, "on the event of the first sampled token"
    prompt = got[0].prompt_logprobs
    assert prompt is not None
    return prompt


def _check(hf: Any, ids: list[int], got: list[TokenLogprob], top: int) -> None:
    want = _want(hf, ids)
    assert [lp.token_id for lp in got] == ids
    assert got[0].logprob == 0.0 and got[0].top == ()  # nothing precedes the first token
    worst = 0.0
    for p in range(1, len(ids)):
        expected = want[p - 1]
        worst = max(worst, abs(got[p].logprob - expected[ids[p]].item()))
        best = expected.topk(top)
        assert [t for t, _, _ in got[p].top] == best.indices.tolist()
        for (_, _, value), ref in zip(got[p].top, best.values.tolist(), strict=True):
            assert abs(value - ref) < TOLERANCE
    print(f"{len(ids)} prompt tokens: worst |logprob - float32 reference| {worst:.2e}")
    assert worst < TOLERANCE


@pytest.mark.slow
def test_prompt_logprobs_match_float32_transformers(reference: tuple[Any, Engine]) -> None:
    hf, engine = reference
    ids = engine.encode_prompt(TEXT, chat=False)
    assert len(ids) > 2 * engine.prefill_chunk
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=True, top_logprobs=3,
                            prompt_logprobs=True)  # fmt: skip
    seq = engine.add(ids, params, chat=False)
    _check(hf, ids, _first(drain(engine)[seq]), top=3)


@pytest.mark.slow
def test_a_cached_prefix_is_computed_again_and_every_choice_gets_them(
    reference: tuple[Any, Engine],
) -> None:
    hf, engine = reference
    ids = engine.encode_prompt(TEXT, chat=False)
    plain = SamplingParams(max_tokens=1, temperature=0)
    engine.add(ids, plain, chat=False)
    drain(engine)  # the prompt's blocks are in the prefix cache now
    hits = engine.statistics().prefix_cache_hits_tokens
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=1, top_logprobs=1, n=2,
                            prompt_logprobs=True)  # fmt: skip
    seq = engine.add(ids, params, chat=False)
    events = drain(engine)[seq]
    assert engine.statistics().prefix_cache_hits_tokens == hits  # no block taken from the cache
    first, second = _first(events, 0), _first(events, 1)
    assert first == second
    _check(hf, ids, first, top=1)
    seq = engine.add(ids, plain, chat=False)
    again = drain(engine)[seq]  # the cache still serves the others
    assert engine.statistics().prefix_cache_hits_tokens > hits
    assert all(e.prompt_logprobs is None for e in again)


@pytest.mark.slow
def test_without_the_flag_no_prompt_logprobs(reference: tuple[Any, Engine]) -> None:
    _hf, engine = reference
    ids = engine.encode_prompt("Hello there", chat=False)
    seq = engine.add(ids, SamplingParams(max_tokens=2, logprobs=True), chat=False)
    events = drain(engine)[seq]
    assert all(e.prompt_logprobs is None for e in events)
