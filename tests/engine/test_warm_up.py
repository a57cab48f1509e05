"""The warm-up: after it, a first request runs no kind of work the warm-up did not run first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_trio.engine.block_pool import BLOCK_TOKENS
from neuron_trio.engine.engine import Engine
from neuron_trio.engine.model.linear import NATIVE_DENSE_MIN_ROWS
from neuron_trio.engine.types import Constraint, SamplingParams
from neuron_trio.engine.warm_up import WARM_UP_PROMPT_TOKENS, warm_up
from tests.engine.tiny_gguf import write_tiny_llama

Kind = tuple[str, ...]


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Q4_1 under "auto": the native kernel, as the built-in model; with dense copies (see
    # `copies`) prefill chunks of NATIVE_DENSE_MIN_ROWS rows or more take those instead.
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "q4.gguf", qtype="Q4_1", seed=5)


@pytest.fixture(params=[True, False], ids=["dense copies", "no dense copies"])
def copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the native layers keep dense copies (as on a CPU with AMX) in the engines a
    test then loads: both ways on any machine (packing.native_dense_copies)."""
    monkeypatch.setenv("NEURON_DENSE_COPIES", "1" if request.param else "0")
    return bool(request.param)


def _engine(path: Path, max_batch: int = 8) -> Engine:
    return Engine.from_gguf(path, dtype="auto", device="cpu", max_batch=max_batch, context=256)


class WorkSpy:
    """Records the kind of every forward and sampling call, and which lazily built parts of
    the engine exist (the grammar compiler, its mask thread, the tool-call format)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kinds: set[Kind] = set()
        runner, sampler = engine.runner, engine.sampler
        forward, sample = runner.forward, sampler.sample

        dense_rows = runner.dense_prefill_rows
        self.rows: list[int] = []  # of every forward

        def spy_forward(ids: torch.Tensor, pos: Any, slots: Any, **kw: Any) -> Any:
            b, t = ids.shape
            self.rows.append(b * t)
            self.kinds.add(
                (
                    "forward",
                    "decode" if t == 1 else "prefill",
                    "dense" if dense_rows is not None and b * t >= dense_rows else "int",
                    "padded" if kw.get("lengths") is not None else "even",
                    "batch" if b > 1 else "single",
                )
            )
            return forward(ids, pos, slots, **kw)

        def spy_sample(logits: torch.Tensor, states: Any, *rest: Any) -> Any:
            greedy = all(s.params.temperature == 0 for s in states)
            self.kinds.add(("sample", "greedy" if greedy else "random", "masked" if rest else ""))
            return sample(logits, states, *rest)

        runner.forward = spy_forward  # type: ignore[method-assign]
        sampler.sample = spy_sample  # type: ignore[method-assign]

    def lazy_parts(self) -> list[object]:
        e = self.engine
        return [e._grammar, e._masks, e._tool_format]

    def new_work(self, run: Callable[[], None]) -> tuple[set[Kind], list[bool]]:
        """The kinds `run` used that had not run before, and which lazy parts it built."""
        before, parts = set(self.kinds), self.lazy_parts()
        run()
        built = [a is None and b is not None for a, b in zip(parts, self.lazy_parts(), strict=True)]
        return self.kinds - before, built


def _chat(engine: Engine, content: str, params: SamplingParams) -> None:
    prompt = engine.encode_prompt(
        engine.render_chat([{"role": "user", "content": content}]), chat=True
    )
    engine.add(prompt, params, chat=True)
    while engine.has_work:
        engine.step()


GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=1, logprobs=True)
JSON = SamplingParams(
    max_tokens=6, temperature=0.0, constraint=Constraint(kind="json", schema='{"type":"object"}')
)
# What the warm-up prepares: a first plain chat; structured output (JSON below) is built by
# its first request (the grammar engine's tokenizer: engine.text.structured.grammar).
FIRST_REQUESTS = [
    ("a greedy chat", GREEDY),
    ("a sampled chat with logprobs", SAMPLED),
]
SHORT = "the cat sat on the mat today"
LONG = " ".join([SHORT] * 12)  # past NATIVE_DENSE_MIN_ROWS tokens: the dense prefill


@pytest.mark.parametrize("content", [SHORT, LONG])
@pytest.mark.parametrize(("what", "params"), FIRST_REQUESTS)
def test_a_first_request_after_warm_up_runs_nothing_new(
    tiny_q4: Path, copies: bool, what: str, params: SamplingParams, content: str
) -> None:
    engine = _engine(tiny_q4)
    spy = WorkSpy(engine)
    warm_up(engine)
    new, built = spy.new_work(lambda: _chat(engine, content, params))
    assert new == set(), f"{what}: the first request ran {new}, which the warm-up did not"
    assert not any(built), f"{what}: the first request built lazy parts {built}"


def test_ready_does_not_wait_for_the_grammar_engine_a_first_json_request_builds_it(
    tiny_q4: Path,
) -> None:
    """llguidance's tokenizer (~1.1 s of GIL-holding Rust for a 262,144-token vocabulary) is
    not built by the warm-up; the first json_object request builds it and is served."""
    engine = _engine(tiny_q4)
    warm_up(engine)
    assert engine._grammar is None or not engine._grammar.tokenizer_built
    prompt = engine.encode_prompt(engine.render_chat([{"role": "user", "content": "x"}]), chat=True)
    engine.add(prompt, JSON, chat=True)
    events = []
    while engine.has_work:
        events.extend(engine.step())
    assert engine._grammar is not None and engine._grammar.tokenizer_built
    assert all(e.error is None for e in events) and events[-1].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("content", "path"), [(SHORT, "int"), (LONG, "dense")])
@pytest.mark.parametrize(("what", "params"), [*FIRST_REQUESTS, ("a json_object chat", JSON)])
def test_without_warm_up_the_first_request_does_run_new_work(
    tiny_q4: Path,
    what: str,
    params: SamplingParams,
    content: str,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The spy sees what the previous test checks is absent (so that test can fail), on
    both prefill paths (with dense copies: there are two)."""
    monkeypatch.setenv("NEURON_DENSE_COPIES", "1")
    engine = _engine(tiny_q4)
    spy = WorkSpy(engine)
    new, built = spy.new_work(lambda: _chat(engine, content, params))
    assert ("forward", "prefill", path, "even", "single") in new, what
    assert any(built) == (params.constraint is not None)


@pytest.mark.parametrize("max_batch", [1, 2, 8])
def test_warm_up_leaves_the_engine_idle_with_every_slot_free(
    tiny_q4: Path, copies: bool, max_batch: int
) -> None:
    engine = _engine(tiny_q4, max_batch=max_batch)
    report = warm_up(engine)
    assert not engine.has_work and engine.free_slots == max_batch
    longs = ["long completion"] if copies else []
    assert report.requests == [
        "single greedy",
        "sampled",
        *longs,
        "greedy chat",
        "short completion",
    ]
    assert report.steps >= 6 and report.tokens >= 8  # every request got its 2 tokens
    # and the engine serves as before
    _chat(engine, "hello", GREEDY)
    assert engine.free_slots == max_batch


def test_warm_up_refuses_a_busy_engine(tiny_q4: Path) -> None:
    engine = _engine(tiny_q4)
    engine.add([1, 5, 6], GREEDY, chat=False)
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(engine)


def test_a_model_without_a_chat_template_warms_up_on_completions(
    tmp_path: Path, copies: bool
) -> None:
    base = write_tiny_llama(tmp_path / "base.gguf", qtype="Q4_1", chat_template=None)
    engine = _engine(base)
    report = warm_up(engine)
    assert len(report.requests) == (5 if copies else 4) and not engine.has_work


def test_a_context_shorter_than_the_warm_up_prompts_still_warms_up(tiny_q4: Path) -> None:
    engine = Engine.from_gguf(tiny_q4, dtype="auto", device="cpu", max_batch=2, context=16)
    report = warm_up(engine)
    assert report.tokens >= 8 and engine.free_slots == 2


def test_the_long_request_reaches_the_dense_rows_with_a_tokenizer_of_whole_words() -> None:
    """The warm-up's long prompt is as short as it may be: with a tokenizer that spells each
    word as one token (the built-in model's: "hello" and " hello" are tokens), it still makes
    a prefill of NATIVE_DENSE_MIN_ROWS rows."""
    from neuron_trio.engine import warm_up as warm_up_module
    from neuron_trio.engine.gguf.builtin import builtin_model_path
    from neuron_trio.engine.gguf.file import GGUFFile
    from neuron_trio.engine.text.tokenizer import Tokenizer

    with GGUFFile(builtin_model_path()) as gf:
        tokenizer = Tokenizer.from_metadata(gf.metadata)
    text = warm_up_module._LONG_TEXT
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.split()) == NATIVE_DENSE_MIN_ROWS


def test_each_request_runs_no_more_prompt_rows_than_its_purpose_needs(
    tiny_q4: Path, copies: bool
) -> None:
    """The single greedy chat (first) runs only the last WARM_UP_PROMPT_TOKENS of its 54
    tokens, the long request exactly the rows that take the dense copies, and none runs
    without them."""
    engine = _engine(tiny_q4)
    spy = WorkSpy(engine)
    warm_up(engine)
    assert spy.rows[0] == WARM_UP_PROMPT_TOKENS
    long_rows = [rows for rows in spy.rows if rows >= NATIVE_DENSE_MIN_ROWS]
    assert long_rows == ([NATIVE_DENSE_MIN_ROWS] if copies else [])


# ChatML with a default system prompt, as Qwen2.5's: every chat starts with the same blocks.
SYSTEM_PROMPT_TEMPLATE = (
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{{ '<|im_start|>assistant\\n' }}"
)


def test_a_first_chat_finds_the_start_of_the_template_cached(tmp_path: Path) -> None:
    """The plain chats run whole: a first real chat's prefill skips the template's common
    start (a block of it at least), as the tenth chat's does."""
    path = write_tiny_llama(
        tmp_path / "system.gguf", qtype="Q4_1", chat_template=SYSTEM_PROMPT_TEMPLATE
    )
    engine = _engine(path)
    warm_up(engine)
    before = engine.pool.statistics().hit_tokens
    _chat(engine, "What is the capital of Peru?", GREEDY)
    assert engine.pool.statistics().hit_tokens - before >= BLOCK_TOKENS
