"""A sampled request's tokens follow the same distribution with prompt-lookup speculation as
without: a two-sample chi-square test on a tiny model (slow: 800 short requests)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.types import SamplingParams
from tests.engine.tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.slow

SAMPLES = 400  # requests per arm
# chi-square critical values at alpha = 0.01 by degrees of freedom
CRITICAL = {1: 6.63, 2: 9.21, 3: 11.34}


def _outcomes(engine: Engine, first_seed: int) -> Counter[tuple[bool, bool]]:
    """Over SAMPLES requests (seeds first_seed ...): whether the 2nd token repeats the 1st
    and the 3rd the 2nd. The draft of a repeating prompt proposes exactly those repeats, so
    a wrong acceptance rule moves these frequencies first."""
    prompt = engine.encode_prompt("abc abc abc abc abc abc", chat=False)
    counts: Counter[tuple[bool, bool]] = Counter()
    for start in range(0, SAMPLES, 8):
        ids = []
        for i in range(8):
            params = SamplingParams(
                temperature=6.0, max_tokens=3, ignore_eos=True, seed=first_seed + start + i
            )
            ids.append(engine.add(prompt, params, chat=False))
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        while engine.has_work:
            for event in engine.step():
                tokens[event.seq_id] += event.token_ids
        for seq_tokens in tokens.values():
            a, b, c = seq_tokens
            counts[(a == b, b == c)] += 1
    return counts


def _chi_square(a: Counter[tuple[bool, bool]], b: Counter[tuple[bool, bool]]) -> tuple[float, int]:
    """The two-sample statistic (equal sizes) over the categories seen, and its degrees of
    freedom."""
    cells = sorted(set(a) | set(b))
    stat = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells)
    return stat, len(cells) - 1


def test_sampled_distribution_is_unchanged(tmp_path: Path) -> None:
    # Power: with 400 a side and 4 categories (3 degrees of freedom) at alpha = 0.01, a shift
    # of 0.10 of probability between two categories near 0.3 gives a noncentrality of ~15
    # (found with probability ~0.8), a shift of 0.15 one of ~33 (~0.99). Always keeping the
    # draft (no rejection) moves ~0.3 and fails by far. Seeds are fixed: the test is
    # deterministic, so alpha is the chance that a correct rule's seeds fall badly once.
    path = write_tiny_llama(tmp_path / "tiny.gguf", seed=3)  # peaked on repeating itself

    def engine(k: int) -> Engine:
        built = Engine.from_gguf(
            path, dtype="float32", max_batch=8, context=128, speculative_tokens=k
        )
        if built.speculator is not None:
            built.speculator.max_rows = 8
        return built

    plain = _outcomes(engine(0), 0)
    spec_engine = engine(4)
    spec = _outcomes(spec_engine, 1_000_000)  # other seeds: independent samples
    assert len(plain) >= 3, plain  # the outcome is not one category
    stat, df = _chi_square(plain, spec)
    assert stat < CRITICAL[df], (stat, plain, spec)
    assert spec_engine.speculator is not None
    counts = spec_engine.speculator.counts
    assert 0 < counts.accepted < counts.proposed  # drafts both kept and rejected
