"""Sampling on hand-made logits: each option's effect, seeds, logprobs, the greedy fast path."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from neuron_trio.engine.sampling import Sampler, SamplingState, argmax_rows
from neuron_trio.engine.types import SamplingParams


def params(**kw: Any) -> SamplingParams:
    return SamplingParams(**kw)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float32).log()


def filtered(probs: list[float], **kw: Any) -> list[float]:
    out = Sampler._filtered_probs(logits_of(probs), [params(**kw)])
    return [round(v, 6) for v in out[0].tolist()]


def test_greedy_fast_path_is_one_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 4.9]])
    rows = [SamplingState(params(temperature=0.0), [1, 2]) for _ in range(2)]
    calls = []
    monkeypatch.setattr(
        Sampler, "_filtered_probs", staticmethod(lambda *a: calls.append(a))
    )  # must not be reached
    results = Sampler().sample(logits, rows)
    assert [r.token_id for r in results] == [1, 0]
    assert all(r.logprob is None for r in results)
    assert calls == []
    assert rows[0].output_ids == [1] and rows[1].output_counts == {0: 1}


def test_argmax_rows_is_torch_argmax_ties_and_nan_included() -> None:
    nan, inf = float("nan"), float("inf")
    rows = [
        [1.0, 3.0, 3.0, 2.0],
        [-inf, -inf, -inf, -inf],
        [0.0, nan, 5.0, nan],
        [7.0, 1.0, 7.0, inf],
    ]
    x = torch.tensor(rows)
    assert argmax_rows(x) == x.argmax(dim=-1).tolist() == [1, 0, 1, 3]
    wide = torch.randn(8, 49152)  # the built-in model's vocabulary, a batch of 8
    wide[3, 100] = wide[3, 200] = wide[3].max() + 1  # a tie: the first wins
    assert argmax_rows(wide) == wide.argmax(dim=-1).tolist()
    assert argmax_rows(wide[:, ::2]) == wide[:, ::2].argmax(dim=-1).tolist()  # strided
    assert argmax_rows(wide.bfloat16()) == wide.bfloat16().argmax(dim=-1).tolist()


def test_repetition_penalty_over_prompt_and_output() -> None:
    # token 0 was in the prompt: 2.0 / 1.5 = 1.33 < 1.9; a negative logit is multiplied
    logits = torch.tensor([[2.0, 1.9, -0.5, -0.6]])
    state = SamplingState(params(temperature=0.0, repetition_penalty=1.5), [0, 3])
    assert Sampler().sample(logits, [state])[0].token_id == 1
    # now token 1 is in the output too: 1.9 / 1.5 = 1.27 < 2.0 / 1.5 = 1.33 -> token 0
    assert Sampler().sample(logits, [state])[0].token_id == 0
    row = logits[0].clone()
    state.apply_penalties(row)
    assert row.tolist() == pytest.approx([2.0 / 1.5, 1.9 / 1.5, -0.5, -0.6 * 1.5])


def test_presence_and_frequency_penalties_count_output_only() -> None:
    state = SamplingState(params(presence_penalty=0.5, frequency_penalty=0.25), [2, 2, 2])
    for t in (0, 0, 1):
        state.append(t)
    row = torch.zeros(4)
    state.apply_penalties(row)
    # token 0: twice -> 2*0.25 + 0.5; token 1: once -> 0.25 + 0.5; prompt token 2 untouched
    assert row.tolist() == pytest.approx([-1.0, -0.75, 0.0, 0.0])
    # greedy with the penalty moves off a repeated token
    state = SamplingState(params(temperature=0.0, frequency_penalty=2.0))
    logits = torch.tensor([[1.0, 0.5, 0.0]])
    picks = [Sampler().sample(logits, [state])[0].token_id for _ in range(3)]
    assert picks == [0, 1, 2]


def test_temperature_scales_logits() -> None:
    probs = [0.5, 0.3, 0.2]
    at_1 = filtered(probs, temperature=1.0)
    assert at_1 == pytest.approx(probs, abs=1e-6)
    at_half = filtered(probs, temperature=0.5)
    z = sum(p**2 for p in probs)
    assert at_half == pytest.approx([p**2 / z for p in probs], abs=1e-6)
    assert filtered(probs, temperature=2.0)[0] < 0.5 < at_half[0]


def test_top_k_top_p_min_p() -> None:
    probs = [0.1, 0.5, 0.15, 0.25]
    assert filtered(probs, top_k=2) == pytest.approx([0, 0.5 / 0.75, 0, 0.25 / 0.75], abs=1e-6)
    assert filtered(probs, top_k=1) == [0, 1, 0, 0]
    # top_p: keep the smallest best-first set whose mass reaches p
    assert filtered(probs, top_p=0.7) == pytest.approx([0, 0.5 / 0.75, 0, 0.25 / 0.75], abs=1e-6)
    assert filtered(probs, top_p=0.5) == [0, 1, 0, 0]
    assert filtered(probs, top_p=0.76) == pytest.approx(
        [0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9], abs=1e-6
    )
    assert filtered(probs, top_p=1e-9) == [0, 1, 0, 0]
    # min_p: drop what is below min_p times the best token's probability (0.5 * 0.25)
    assert filtered(probs, min_p=0.25) == pytest.approx(
        [0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9], abs=1e-6
    )


def test_top_k_applies_before_top_p() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    # alone, top_p=0.5 keeps two tokens (0.4 < 0.5) ...
    assert sum(v > 0 for v in filtered(probs, top_p=0.5)) == 2
    # ... but after top_k=2 renormalises to [4/7, 3/7], 4/7 already reaches 0.5
    assert filtered(probs, top_k=2, top_p=0.5) == [1, 0, 0, 0]


def test_off_values_leave_the_distribution_unchanged() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 1000) * 4
    off = [params(top_p=1.0, top_k=0, min_p=0.0)] * 3
    assert torch.equal(Sampler._filtered_probs(x, off), x.softmax(dim=-1))
    # top_k >= vocabulary is off too
    assert torch.equal(Sampler._filtered_probs(x, [params(top_k=1000)] * 3), x.softmax(dim=-1))
    # mixed rows: an off row is untouched by its neighbours' filters
    mixed = [params(top_k=5), params(), params(top_p=0.3, min_p=0.1)]
    out = Sampler._filtered_probs(x, mixed)
    assert torch.equal(out[1], x[1].softmax(dim=-1))
    assert (out[0] > 0).sum() == 5
    # top-k alone (no top-p in the batch): the same
    out = Sampler._filtered_probs(x, [params(), params(top_k=3), params(top_k=7)])
    assert torch.equal(out[0], x[0].softmax(dim=-1))
    assert [int((r > 0).sum()) for r in out[1:]] == [3, 7]


def _run(state: SamplingState, logits: torch.Tensor, steps: int, batch_with: int = 0) -> list[int]:
    """`steps` tokens for `state`, in a batch with `batch_with` other (unseeded) rows before it."""
    out = []
    for _ in range(steps):
        others = [SamplingState(params(temperature=1.3)) for _ in range(batch_with)]
        batch = logits.expand(batch_with + 1, -1).contiguous()
        out.append(Sampler().sample(batch, [*others, state])[-1].token_id)
    return out


def test_seed_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 500)
    p = params(seed=1234, temperature=1.0)
    alone = _run(SamplingState(p), logits, 20)
    in_batch = _run(SamplingState(p), logits, 20, batch_with=3)
    assert alone == in_batch
    other_seed = _run(SamplingState(params(seed=4321)), logits, 20)
    assert other_seed != alone
    huge = _run(SamplingState(params(seed=2**70 + 1234)), logits, 20)  # any int is a seed
    assert huge == _run(SamplingState(params(seed=2**70 + 1234)), logits, 20)
    assert _run(SamplingState(params(seed=-1)), logits, 3)
    unseeded = [_run(SamplingState(params()), logits, 20) for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_sampling_follows_the_distribution() -> None:
    probs = [0.0, 0.6, 0.3, 0.1, 0.0]
    rows = [SamplingState(params(seed=s)) for s in range(3000)]
    logits = logits_of(probs).expand(len(rows), -1).contiguous()
    tokens = [r.token_id for r in Sampler().sample(logits, rows)]
    freq = [tokens.count(t) / len(tokens) for t in range(5)]
    assert freq == pytest.approx(probs, abs=0.03)
    assert freq[0] == 0 and freq[4] == 0  # never a token of probability 0
    # top_k=1 at temperature 1 is always the best token
    rows = [SamplingState(params(seed=s, top_k=1)) for s in range(50)]
    assert {r.token_id for r in Sampler().sample(logits[:50], rows)} == {1}


def test_logprobs_are_the_raw_distribution() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    names = {0: "a", 1: "b", 2: "c", 3: "d"}
    state = SamplingState(
        params(temperature=0.0, logprobs=True, top_logprobs=2, repetition_penalty=2.0), [1]
    )
    [res] = Sampler(names.__getitem__).sample(logits, [state])
    # the penalty moved the pick to token 2, but the logprob is the model's own
    assert res.token_id == 2
    lp = res.logprob
    assert lp is not None
    expected = torch.log_softmax(logits[0], dim=-1).tolist()
    assert lp.token_id == 2 and lp.text == "c"
    assert lp.logprob == pytest.approx(expected[2])
    assert [(t, s) for t, s, _ in lp.top] == [(1, "b"), (2, "c")]
    assert lp.top[0][2] == pytest.approx(expected[1])
    assert math.isclose(sum(math.exp(v) for v in expected), 1.0, rel_tol=1e-6)
    # sampled rows report the raw distribution too, not the temperature-scaled one
    hot = SamplingState(params(temperature=5.0, logprobs=True, seed=3))
    [res] = Sampler().sample(logits, [hot])
    assert res.logprob is not None
    assert res.logprob.logprob == pytest.approx(expected[res.token_id])
    assert res.logprob.top == () and res.logprob.text == ""


def test_mixed_batch_and_shape_check() -> None:
    logits = torch.tensor([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    rows = [
        SamplingState(params(temperature=0.0)),
        SamplingState(params(temperature=0.7, top_k=1, seed=1)),
        SamplingState(params(temperature=0.0, logprobs=True)),
    ]
    res = Sampler().sample(logits, rows)
    assert [r.token_id for r in res] == [1, 0, 2]
    assert [r.logprob is not None for r in res] == [False, False, True]
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(logits, rows[:2])


def test_top_p_from_candidates_equals_the_full_sort() -> None:
    from neuron_trio.engine import sampling

    gen = torch.Generator().manual_seed(7)
    peaked = torch.randn(4, 5000, generator=gen) * 6  # most mass in a few hundred tokens
    flat = torch.randn(2, 5000, generator=gen) * 0.1
    ks, ps = [5000, 40, 5000, 300], [0.9, 0.8, 0.5, 2.0]
    fast = sampling._top_k_top_p_candidates(peaked, ks, ps)
    assert fast is not None
    assert torch.equal(fast, sampling._top_k_top_p_sorted(peaked, ks, ps))
    assert int((~fast[1]).sum()) <= 40 and int((~fast[3]).sum()) == 300
    # a flat row's best 512 tokens hold far less than 0.9 of the mass: the full sort it is
    assert sampling._top_k_top_p_candidates(flat, [5000, 5000], [0.9, 0.9]) is None
    # top_k above the candidates: the full sort too
    assert sampling._top_k_top_p_candidates(peaked[:1], [600], [0.9]) is None
    # and through the public path, both ways give the same distribution
    mixed = torch.cat([peaked, flat])
    rows = [params(top_p=0.9), params(top_k=40, top_p=0.8), params(), params(top_k=300)]
    rows += [params(top_p=0.9), params()]
    out = Sampler._filtered_probs(mixed, rows)
    assert torch.equal(out[2], peaked[2].softmax(dim=-1))
    assert torch.equal(out[5], flat[1].softmax(dim=-1))
    assert 512 < int((out[4] > 0).sum()) < 5000


def test_logprobs_per_row_counts_in_one_batch() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0], [0.0, 0.0, 0.0, 9.0]])
    rows = [
        SamplingState(params(temperature=0.0, logprobs=True, top_logprobs=3)),
        SamplingState(params(temperature=0.0, logprobs=True)),
        SamplingState(params(temperature=0.0)),
    ]
    res = Sampler(str).sample(logits, rows)
    first, second = res[0].logprob, res[1].logprob
    assert first is not None and second is not None and res[2].logprob is None
    assert [t for t, _, _ in first.top] == [3, 2, 1] and first.text == "3"
    assert second.top == () and second.token_id == 0
    assert second.logprob == pytest.approx(torch.log_softmax(logits[1], -1)[0].item())


def test_logit_bias_moves_greedy_and_sampled_rows_but_not_logprobs() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 4.9], [0.0, 0.0, 9.0]])
    before = logits.clone()
    rows = [
        SamplingState(params(temperature=0.0, logit_bias=((0, 100.0),))),  # greedy, pushed up
        SamplingState(params(temperature=0.0, logit_bias=((0, -100.0),), logprobs=True)),
        SamplingState(params(temperature=1.0, seed=1, logit_bias=((2, -100.0),))),  # sampled
    ]
    results = Sampler().sample(logits, rows)
    assert [r.token_id for r in results[:2]] == [0, 2]
    assert results[2].token_id in (0, 1)  # 9 - 100: never drawn against two logits of 0
    assert torch.equal(logits, before)  # the caller's logits are left alone
    lp = results[1].logprob
    assert lp is not None and math.isclose(lp.logprob, torch.log_softmax(before[1], 0)[2].item())
    # a row without a bias in the same batch keeps the fast path's answer
    free = Sampler().sample(before[:1].clone(), [SamplingState(params(temperature=0.0))])
    assert free[0].token_id == 1
