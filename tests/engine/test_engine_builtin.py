"""The engine on the built-in model (SmolLM2-135M-Instruct): answers, and batching invariance."""

from __future__ import annotations

import pytest
import torch

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.gguf.builtin import builtin_model_path
from neuron_trio.engine.types import SamplingParams
from neuron_trio.errors import SourceError
from tests.engine.drain import drain

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about autumn.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.",
    "What is the largest planet in our solar system?",
]


def _model_path():
    try:
        return builtin_model_path()
    except SourceError as e:
        pytest.skip(str(e))


def _chat(engine: Engine, question: str) -> list[int]:
    text = engine.render_chat([{"role": "user", "content": question}])
    return engine.encode_prompt(text, chat=True)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_capital_of_france(dtype: str) -> None:
    engine = Engine.from_gguf(
        _model_path(), dtype=dtype, device=torch.device("cpu"), max_batch=2, context=512
    )
    params = SamplingParams(temperature=0.0, max_tokens=24)
    seq_id = engine.add(_chat(engine, QUESTIONS[0]), params, chat=True)
    events = drain(engine)[seq_id]
    answer = "".join(e.text for e in events)
    assert "Paris" in answer, answer
    assert events[-1].finish_reason in ("stop", "length")
    if events[-1].finish_reason == "stop":
        assert "<|im_end|>" not in answer


def test_batch_of_eight_gives_the_same_greedy_tokens() -> None:
    engine = Engine.from_gguf(
        _model_path(), dtype="float32", device=torch.device("cpu"), max_batch=8, context=512
    )
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = [_chat(engine, q) for q in QUESTIONS]
    alone = []
    for prompt in prompts:
        seq_id = engine.add(prompt, params, chat=True)
        alone.append([t for e in drain(engine)[seq_id] for t in e.token_ids])
    ids = {engine.add(prompt, params, chat=True): i for i, prompt in enumerate(prompts)}
    events = drain(engine)
    for seq_id, i in ids.items():
        assert [t for e in events[seq_id] for t in e.token_ids] == alone[i], QUESTIONS[i]


SYSTEM = (
    "You are a careful assistant for a geography quiz. Answer in one short sentence, name "
    "the place exactly, and never add a greeting or a follow-up question. "
) * 3


def _answers(engine: Engine, questions: list[str], max_tokens: int) -> list[list[int]]:
    """Each question with the shared system prompt, one request after the other."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = []
    for question in questions:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        ids = engine.encode_prompt(engine.render_chat(messages), chat=True)
        seq_id = engine.add(ids, params, chat=True)
        out.append([t for e in drain(engine)[seq_id] for t in e.token_ids])
    return out


def test_prefix_cache_reuses_a_system_prompt_with_identical_float32_output() -> None:
    def engine(prefix_cache: bool) -> Engine:
        return Engine.from_gguf(
            _model_path(),
            dtype="float32",
            device=torch.device("cpu"),
            max_batch=2,
            context=512,
            prefix_cache=prefix_cache,
        )

    questions = [QUESTIONS[0], "What is the capital of Italy?", QUESTIONS[0]]
    cached, plain = engine(True), engine(False)
    with_cache = _answers(cached, questions, 12)
    without = _answers(plain, questions, 12)
    assert with_cache == without
    stats = cached.statistics()
    # the second and third requests found the system prompt's blocks (the third: its whole
    # prompt but the last block, seen in the first request)
    assert stats.prefix_cache_hits_tokens >= 2 * 5 * 16
    assert stats.prompt_tokens_total < plain.statistics().prompt_tokens_total / 2
    assert plain.statistics().prefix_cache_hits_tokens == 0
