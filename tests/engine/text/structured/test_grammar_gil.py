"""The compile thread must not hold the GIL for long (issue 47): llguidance calls our tokenizer
back, with the GIL held, to tokenize the text a grammar forces; that call must be one that
releases the GIL (HF tokenizers' `encode_batch_fast`), not `encode`, which keeps it.

Structural, not timed: the test checks which backend call the grammar makes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from neuron_trio.engine.text.structured.grammar import GrammarCompiler, detect_tool_format
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.types import Constraint


class _Recording:
    """A tokenizers backend that records which of its methods were called."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if callable(attr):

            def recorded(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return attr(*args, **kwargs)

            return recorded
        return attr


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    from neuron_trio.engine.gguf.builtin import builtin_model_path
    from neuron_trio.engine.gguf.file import GGUFFile

    with GGUFFile(builtin_model_path()) as gf:
        return Tokenizer.from_metadata(gf.metadata)


def test_forced_text_is_tokenized_by_a_call_that_releases_the_gil(smol: Tokenizer) -> None:
    recording = _Recording(smol.backend)
    smol.backend = recording  # type: ignore[assignment]
    try:
        compiler = GrammarCompiler(
            smol,
            stop_ids=[smol.eos_id or 0],
            vocab_size=len(smol.token_bytes),
            tool_format=detect_tool_format(smol, None),
        )
        # a const object: the whole of it is forced text, tokenized at the first mask
        schema = json.dumps({"const": {f"key{j}": j for j in range(50)}})
        state = compiler.compile(Constraint(kind="json", schema=schema))
        state.fill(torch.empty((1, (len(smol.token_bytes) + 31) // 32), dtype=torch.int32), 0)
    finally:
        smol.backend = recording._backend
    assert "encode_batch_fast" in recording.calls
    assert "encode" not in recording.calls  # HF's encode keeps the GIL for the whole text


@pytest.mark.parametrize("text", ['{"key0":0,"key1":1}', " leading space", "naïve 東京 \n\t"])
def test_the_gil_free_call_gives_encodes_ids(smol: Tokenizer, text: str) -> None:
    fast = smol.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
    assert fast == smol.encode(text, add_special_tokens=False)
