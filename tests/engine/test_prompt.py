"""A request's prompt prepared in one pass (`engine/prompt.py`, `Engine.prepare`): templated,
tokenised and checked once; `Engine.add` trusts the `PreparedPrompt` the check made."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_trio.engine import prompt as prompt_module
from neuron_trio.engine.engine import Engine
from neuron_trio.engine.prompt import PreparedPrompt, PromptLimits, check_prompt
from neuron_trio.engine.types import SamplingParams
from neuron_trio.errors import ContextLengthError, RequestError
from tests.engine.tiny_gguf import write_tiny_llama

# context 1024, and a pool of 64 blocks (1024 tokens): the room is the context's
LIMITS = PromptLimits(vocab_size=100, max_batch=4, context=1024, pool_blocks=64)


def _max_tokens(asked: int | None, default: int, prompt_tokens: int) -> int | None:
    prepared = check_prompt(
        [1] * prompt_tokens,
        SamplingParams(max_tokens=asked),
        chat=True,
        limits=LIMITS,
        default_max_tokens=default,
    )
    return prepared.params.max_tokens


def test_default_max_tokens_applies_only_where_the_client_gave_none() -> None:
    assert _max_tokens(None, 300, prompt_tokens=124) == 300
    assert _max_tokens(None, 300, prompt_tokens=924) == 100  # cut to the room left
    assert _max_tokens(7, 300, prompt_tokens=124) == 7
    assert _max_tokens(None, 0, prompt_tokens=124) == 900  # no default: to the end


def test_no_room_for_an_answer_is_refused_with_or_without_a_default() -> None:
    for default in (0, 300):
        with pytest.raises(ContextLengthError, match="no room for an answer"):
            _max_tokens(None, default, prompt_tokens=1024)


def test_a_prepared_prompt_is_made_by_the_check_only() -> None:
    with pytest.raises(TypeError, match="check_prompt"):
        PreparedPrompt((1, 2), False, SamplingParams())
    with pytest.raises(RequestError) as bad:
        check_prompt([1, 100], SamplingParams(), chat=False, limits=LIMITS)
    assert bad.value.param == "prompt"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=3)
    return Engine.from_gguf(
        path, dtype="float32", device=torch.device("cpu"), max_batch=4, context=128
    )


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The prompt lengths `check_request` was called with, in order."""
    seen: list[int] = []
    real = prompt_module.check_request

    def counting(prompt_ids: list[int], params: SamplingParams, **limits: int) -> None:
        seen.append(len(prompt_ids))
        real(prompt_ids, params, **limits)

    monkeypatch.setattr(prompt_module, "check_request", counting)
    return seen


def test_a_chat_is_rendered_encoded_and_checked_once_and_add_trusts_it(
    engine: Engine, checks: list[int]
) -> None:
    messages = [{"role": "user", "content": "hello world"}]
    prepared = engine.prepare(SamplingParams(max_tokens=None), messages=messages)
    expected = engine.encode_prompt(engine.render_chat(messages), chat=True)
    assert (list(prepared.ids), prepared.chat) == (expected, True)
    assert prepared.params.max_tokens == 128 - len(expected)  # resolved: to the end
    assert checks == [len(expected)]
    seq_id = engine.add(prepared)
    assert checks == [len(expected)]  # `add` did not check it again
    engine.cancel(seq_id)


def test_token_ids_are_used_as_they_are_and_checked(
    engine: Engine, checks: list[int], tmp_path: Path
) -> None:
    prepared = engine.prepare(SamplingParams(max_tokens=4), ids=(5, 6))
    assert (prepared.ids, prepared.chat) == ((5, 6), False)
    with pytest.raises(RequestError) as bad:
        engine.prepare(SamplingParams(), ids=(5, engine.vocab_size))
    assert bad.value.param == "prompt"
    # token ids handed to `add` directly (tools, tests) are checked there, once
    engine.cancel(engine.add([5, 6, 7], SamplingParams(max_tokens=4), chat=False))
    assert checks == [2, 2, 3]
