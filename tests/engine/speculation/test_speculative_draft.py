"""Draft-model speculation (engine/speculation/draft_model.py): a pair of tiny random Llamas of one
vocabulary (the target 2 layers, the draft 1 layer: they agree on some tokens) gives what the
target alone gives, for every way a run ends; a draft identical to the target has every
token accepted (its K/V kept in step with the accepted tokens); a draft of another vocabulary
is refused at load, naming both files."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
import torch

from neuron_trio.config import ModelConfig, SpeculativeConfig
from neuron_trio.engine.block_pool import blocks_for
from neuron_trio.engine.engine import Engine
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.load.loader import SingleRunner, load_transformer
from neuron_trio.engine.sequence import Sequence
from neuron_trio.engine.speculation import draft_model
from neuron_trio.engine.speculation.draft_model import (
    DraftCache,
    DraftModel,
    load_draft,
    vocabulary_mismatch,
)
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.types import Constraint, SamplingParams, SequenceEvent
from neuron_trio.errors import ConfigError
from neuron_trio.executor.executor import build_executor
from tests.engine.drain import drain
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
    weights["output.weight"] *= 0.5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): one seed, so they share the embedding and output matrices, and the
    1-layer draft agrees with the 2-layer target on a fair share of tokens."""
    root = tmp_path_factory.mktemp("pair")
    target = write_tiny_llama(root / "target.gguf", seed=3, tied=False, edit_weights=_soften)
    draft = write_tiny_llama(
        root / "draft.gguf", n_layers=1, seed=3, tied=False, edit_weights=_soften
    )
    return target, draft


def _engine(
    path: Path, draft: Path | None = None, k: int = 0, *, max_batch: int = 8, blocks: int = 0
) -> Engine:
    if not blocks:
        engine = Engine.from_gguf(
            path,
            dtype="float32",
            max_batch=max_batch,
            context=128,
            speculative_tokens=k,
            draft_path=draft,
        )
    else:
        with GGUFFile(path) as gguf:  # a small pool: sequences are preempted
            model = load_transformer(gguf, dtype="float32", device=torch.device("cpu"))
            tokenizer = Tokenizer.from_gguf(gguf)
        runner = SingleRunner(model, blocks=blocks, context=128)
        assert draft is not None
        drafter = load_draft(draft, tokenizer.tokens, dtype="float32", device="cpu", context=128)
        engine = Engine(
            runner, tokenizer, max_batch=max_batch, context=128, speculative_tokens=k, draft=drafter
        )
    if engine.speculator is not None:
        engine.speculator.max_rows = max_batch  # drafts however many rows decode together
    return engine


def _counts(engine: Engine) -> tuple[int, int]:
    assert engine.speculator is not None
    return engine.speculator.counts.proposed, engine.speculator.counts.accepted


def _drafter(engine: Engine) -> DraftModel:
    assert engine.speculator is not None and engine.speculator.draft is not None
    return engine.speculator.draft


@pytest.fixture(scope="module")
def plain(pair: tuple[Path, Path]) -> list[list[int]]:
    return [tokens_of(e) for e in run_prompts(_engine(pair[0]), PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_is_the_same_with_a_draft_model(
    pair: tuple[Path, Path], plain: list[list[int]], k: int
) -> None:
    engine = _engine(*pair, k)
    # one at a time (batch 1) and all together (drafting and plain rows in one step; six
    # sequences' draft caches do not fit the draft's pool: the oldest are dropped)
    alone = [tokens_of(run_prompts(engine, [p], GREEDY)[0]) for p in PROMPTS]
    together = [tokens_of(e) for e in run_prompts(engine, PROMPTS, GREEDY)]
    assert alone == plain
    assert together == plain
    proposed, accepted = _counts(engine)
    assert 0 < accepted < proposed  # drafts were kept and rejected
    stats = engine.statistics()  # what /metrics counts
    assert (stats.speculative_proposed_tokens, stats.speculative_accepted_tokens) == (
        proposed,
        accepted,
    )


def test_a_draft_identical_to_the_target_has_every_token_accepted(
    pair: tuple[Path, Path], plain: list[list[int]]
) -> None:
    # the draft's K/V must follow the accepted tokens exactly for its greedy picks to be
    # the target's at every position, across whole runs
    engine = _engine(pair[0], pair[0], 4)
    assert [tokens_of(run_prompts(engine, [p], GREEDY)[0]) for p in PROMPTS] == plain
    proposed, accepted = _counts(engine)
    assert proposed > 100 and accepted == proposed


def test_a_mixed_batch_with_plain_and_constrained_sequences(
    pair: tuple[Path, Path], plain: list[list[int]]
) -> None:
    json = SamplingParams(
        temperature=0.0, max_tokens=20, constraint=Constraint("json", '{"type":"object"}')
    )
    base = _engine(pair[0])
    ids = [base.add(base.encode_prompt(p, chat=False), json, chat=False) for p in PROMPTS[:2]]
    events = drain(base)
    constrained = [tokens_of(events[i]) for i in ids]

    engine = _engine(pair[0], pair[0], 4)
    greedy = [engine.add(engine.encode_prompt(p, chat=False), GREEDY, chat=False) for p in PROMPTS]
    ids = [engine.add(engine.encode_prompt(p, chat=False), json, chat=False) for p in PROMPTS[:2]]
    events = drain(engine)
    assert [tokens_of(events[i]) for i in greedy] == plain
    assert [tokens_of(events[i]) for i in ids] == constrained  # never drafted, same tokens
    proposed, accepted = _counts(engine)
    assert proposed == accepted > 0


def test_max_tokens_and_stop_strings_cut_inside_an_accepted_run(pair: tuple[Path, Path]) -> None:
    # the identical draft makes every run k + 1 tokens long: cuts land inside them
    plain_engine, engine = _engine(pair[0]), _engine(pair[0], pair[0], 8)
    for max_tokens in range(1, 20):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        want = run_prompts(plain_engine, PROMPTS[:2], params)
        got = run_prompts(engine, PROMPTS[:2], params)
        assert [tokens_of(e) for e in got] == [tokens_of(e) for e in want], max_tokens
        assert all(len(tokens_of(e)) == max_tokens for e in got)
        assert all(e[-1].finish_reason == "length" for e in got)
    full = text_of(run_prompts(plain_engine, PROMPTS[2:3], GREEDY)[0])
    for cut in (5, 11, 17, 23):
        stop = full[cut : cut + 2]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=(stop,))
        want_events = run_prompts(plain_engine, PROMPTS[2:3], params)[0]
        got_events = run_prompts(engine, PROMPTS[2:3], params)[0]
        assert text_of(got_events) == text_of(want_events), stop
        assert got_events[-1].finish_reason == "stop"
    assert _counts(engine)[1] > 0


def test_seeded_sampling_and_logprobs_are_those_without_speculation(
    pair: tuple[Path, Path],
) -> None:
    params = SamplingParams(
        temperature=0.8, max_tokens=30, ignore_eos=True, seed=11, n=2, logprobs=True
    )
    want = run_prompts(_engine(pair[0]), PROMPTS[:3], params)
    engine = _engine(pair[0], pair[0], 4)  # its greedy drafts are often the draw
    got = run_prompts(engine, PROMPTS[:3], params)

    def by_choice(events: list[SequenceEvent]) -> dict[int, list[tuple[int, float]]]:
        out: dict[int, list[tuple[int, float]]] = {}
        for e in events:
            out.setdefault(e.index, []).extend(
                (x.token_id, round(x.logprob, 4)) for x in e.logprobs or ()
            )
        return out

    assert [by_choice(e) for e in got] == [by_choice(e) for e in want]
    assert _counts(engine)[1] > 0


def test_preempted_sequences_give_the_same_tokens(
    pair: tuple[Path, Path], plain: list[list[int]]
) -> None:
    engine = _engine(*pair, 4, max_batch=4, blocks=12)
    assert [tokens_of(e) for e in run_prompts(engine, PROMPTS[:4], GREEDY)] == plain[:4]
    assert engine.scheduler.preemptions > 0
    assert _counts(engine)[1] > 0
    assert engine.pool.statistics().used == 0


def test_the_draft_cache_drops_rejected_positions_and_finished_sequences(
    pair: tuple[Path, Path],
) -> None:
    engine = _engine(*pair, 8)
    drafter = _drafter(engine)
    for prompt in PROMPTS:
        engine.add(engine.encode_prompt(prompt, chat=False), GREEDY, chat=False)
    while engine.has_work:
        engine.step()
        for cache in drafter.caches.values():
            # blocks for what it wrote at most; what it is sure of is the sequence's
            written = cache.sure + len(cache.tail)
            assert len(cache.blocks) <= blocks_for(written)
            seq = cache.seq
            assert cache.sure <= seq.num_prompt + seq.num_output
    proposed, accepted = _counts(engine)
    assert 0 < accepted < proposed
    drafter.release_finished()
    assert not drafter.caches
    assert sum(len(d.blocks) for d in drafter.donors.values()) == drafter.pool.statistics().used
    drafter.clear()
    assert drafter.pool.statistics().used == 0


def test_each_draft_is_what_a_fresh_draft_model_proposes(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # after rejections the cache must hold the accepted tokens' K/V only: each proposal
    # equals the one of a draft model with an empty cache given the same tokens
    engine = _engine(*pair, 6)
    drafter = _drafter(engine)
    seen: list[tuple[np.ndarray, int, list[int]]] = []
    propose = DraftModel.propose

    def spy(self: DraftModel, seq: Sequence, tokens: np.ndarray, k: int) -> list[int]:
        out = propose(self, seq, tokens, k)
        if out:
            seen.append((tokens.copy(), k, out))
        return out

    monkeypatch.setattr(DraftModel, "propose", spy)
    run_prompts(engine, PROMPTS[:3], GREEDY)
    proposed, accepted = _counts(engine)
    assert len(seen) > 10 and 0 < accepted < proposed
    monkeypatch.undo()
    stand_in = cast(Sequence, SimpleNamespace(seq_id=1, is_finished=False))
    for tokens, k, out in seen:
        fresh = DraftModel(drafter.runner)  # the same weights and KV pool, nothing cached
        assert fresh.propose(stand_in, tokens, k) == out


def test_a_cache_follows_a_sequence_that_grew_by_several_tokens(pair: tuple[Path, Path]) -> None:
    # a sequence may gain several tokens between two proposals (plain steps during a
    # cool-down, a batch above max_rows): the draft's tokens that disagree with them must
    # not be kept, and those that agree may be
    with GGUFFile(pair[1]) as gguf:
        model = load_transformer(gguf, dtype="float32", device=torch.device("cpu"))
    runner = SingleRunner(model, blocks=40, context=128)
    stand_in = cast(Sequence, SimpleNamespace(seq_id=1, is_finished=False))
    base = np.arange(20, 40, dtype=np.int64)
    for kept in range(4):  # how many of the draft's tokens the sequence then has
        drafter = DraftModel(runner)
        first = drafter.propose(stand_in, base, 5)
        other = (first[kept] + 1) % 200
        grown = np.array([*base, *first[:kept], other, 7, 8, 9], dtype=np.int64)
        got = drafter.propose(stand_in, grown, 5)
        assert drafter.caches[1].sure == len(grown)
        assert got == DraftModel(runner).propose(stand_in, grown, 5), kept


def test_a_later_sequence_starts_on_a_finished_ones_prefix(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the identical draft accepts everything only if the shared blocks hold the right K/V
    shared = " ".join(PROMPTS[:3])  # 3 full blocks and more
    prompts = [shared + " one", shared + " two", PROMPTS[5], shared + " three"]
    want = [tokens_of(run_prompts(_engine(pair[0]), [p], GREEDY)[0]) for p in prompts]
    engine = _engine(pair[0], pair[0], 4)
    fed: list[int] = []
    forward = DraftModel._forward

    def spy(self: DraftModel, cache: DraftCache, ids: list[int], start: int) -> torch.Tensor:
        fed.append(len(ids))
        return forward(self, cache, ids, start)

    monkeypatch.setattr(DraftModel, "_forward", spy)
    firsts = []
    for prompt, tokens in zip(prompts, want, strict=True):
        fed.clear()
        assert tokens_of(run_prompts(engine, [prompt], GREEDY)[0]) == tokens
        firsts.append(fed[0])  # the draft's first forward: the prompt less what it reused
    proposed, accepted = _counts(engine)
    assert proposed > 50 and accepted == proposed
    assert firsts[1] < firsts[0] - 40 and firsts[3] < firsts[0] - 40 and firsts[2] > 5


def test_a_long_prompt_is_caught_up_a_chunk_a_step(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_model, "CATCHUP", 8)
    prompt = " ".join(PROMPTS[:2])  # ~30 tokens: four catch-up steps before the first draft
    want = tokens_of(run_prompts(_engine(pair[0]), [prompt], GREEDY)[0])
    engine = _engine(pair[0], pair[0], 4)
    seq_id = engine.add(engine.encode_prompt(prompt, chat=False), GREEDY, chat=False)
    events: list[SequenceEvent] = []
    first_draft = None
    while engine.has_work:
        events += engine.step()
        if first_draft is None and _counts(engine)[0]:
            first_draft = engine._steps
    assert tokens_of([e for e in events if e.seq_id == seq_id]) == want
    assert first_draft is not None and first_draft >= 4


def test_a_draft_of_another_vocabulary_is_refused_naming_both(
    tmp_path: Path, pair: tuple[Path, Path]
) -> None:
    def rename(tokens: list[str], types: list[int], merges: list[str]) -> None:
        tokens[40] = "zz"

    other = write_tiny_llama(tmp_path / "other.gguf", n_layers=1, seed=3, edit_vocab=rename)
    spec = ModelConfig(
        name="t",
        source="target-src",
        dtype="float32",
        context=128,
        speculative=SpeculativeConfig(method="draft", source="draft-src"),
    )
    with pytest.raises(ConfigError) as info:
        build_executor(spec, pair[0], [torch.device("cpu")], draft_path=other)
    message = str(info.value)
    assert "\n" not in message
    assert "'draft-src'" in message and "'target-src'" in message and "token 40" in message
    executor = build_executor(spec, pair[0], [torch.device("cpu")], draft_path=pair[1])
    assert _drafter(executor.engine).runner.config.n_layers == 1


def test_vocabulary_mismatch() -> None:
    assert vocabulary_mismatch(["a", "b"], ["a", "b"]) is None
    assert vocabulary_mismatch(["a", "b"], ["a"]) == "1 tokens, the target has 2"
    assert vocabulary_mismatch(["a", "b"], ["a", "c"]) == "token 1 is 'c', the target's is 'b'"


def test_a_finished_sequence_lends_its_prefix_only_within_its_cache_salt(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another tenant's identical prefix is caught up again: a skipped catch-up would be a
    # timing hint that someone sent it, as a shared prefix cache would be.
    shared = " ".join(PROMPTS[:3])
    engine = _engine(pair[0], pair[0], 4)
    fed: list[int] = []
    forward = DraftModel._forward

    def spy(self: DraftModel, cache: DraftCache, ids: list[int], start: int) -> torch.Tensor:
        fed.append(len(ids))
        return forward(self, cache, ids, start)

    monkeypatch.setattr(DraftModel, "_forward", spy)
    firsts = []
    for suffix, salt in ((" one", b"a"), (" two", b"b"), (" three", b"a")):
        fed.clear()
        ids = engine.encode_prompt(shared + suffix, chat=False)
        engine.add(ids, GREEDY, chat=False, cache_salt=salt)
        drain(engine)
        firsts.append(fed[0])
    assert firsts[1] > firsts[0] - 10  # another salt: nothing reused
    assert firsts[2] < firsts[0] - 40  # the same salt: the donor's blocks
