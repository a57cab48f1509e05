"""Prompt-lookup speculation on the built-in model: greedy answers are the same token for token
with and without it, in float32 and on the quantised kernels (slow: loads the model)."""

from __future__ import annotations

import pytest
import torch

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.gguf.builtin import builtin_model_path
from neuron_trio.engine.speculation.speculative import Speculator
from neuron_trio.engine.types import SamplingParams
from neuron_trio.errors import SourceError
from tests.engine.drain import drain

pytestmark = pytest.mark.slow

PROMPTS = [  # answers that repeat their input, and one that does not
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
    'Copy this JSON: {"name": "Ada Lovelace", "city": "London", "year": 1843}',
    "Write a haiku about autumn.",
]


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_greedy_answers_are_the_same(dtype: str) -> None:
    try:
        path = builtin_model_path()
    except SourceError as e:
        pytest.skip(str(e))
    engine = Engine.from_gguf(path, dtype=dtype, device=torch.device("cpu"), max_batch=4)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    prompts = [
        engine.encode_prompt(engine.render_chat([{"role": "user", "content": p}]), chat=True)
        for p in PROMPTS
    ]
    answers = {}
    for k in (0, 6):
        engine.speculator = Speculator(k, max_rows=4) if k else None
        ids = [engine.add(p, params, chat=True) for p in prompts]  # together: one batch
        events = drain(engine)
        answers[k] = [[t for e in events[i] for t in e.token_ids] for i in ids]
    assert answers[6] == answers[0]
    assert engine.speculator is not None and engine.speculator.counts.accepted > 0
