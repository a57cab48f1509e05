"""The real Gemma 3 270M (Q4_K_M) against transformers' float32 reference (slow).

The reference (tests/engine/data/gemma3_270m_reference.json) is transformers' own output for
this file, recorded by bench/gemma_reference.py: running transformers here would take minutes
(see that script). neuron runs live: the file's tokenizer, float32 weights, greedy decoding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.load.loader import load_transformer
from neuron_trio.engine.text.tokenizer import Tokenizer
from tests.engine.slot_runner import SlotRunner
from tests.gemma_model import PROMPTS, gemma_path

pytestmark = pytest.mark.slow

REFERENCE = Path(__file__).parent.parent / "data" / "gemma3_270m_reference.json"


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(REFERENCE.read_text())
    assert [c["prompt"] for c in doc["cases"]] == PROMPTS
    return doc


def test_gemma3_greedy_text_and_tokens_equal_transformers(reference: dict[str, Any]) -> None:
    path = gemma_path()
    with GGUFFile(path) as gf:
        assert gf.config.arch == "gemma3" and gf.config.sliding_window == 512
        tokenizer = Tokenizer.from_metadata(gf.metadata)
        model = load_transformer(gf, dtype="float32", device="cpu")
    cases = reference["cases"]
    runner = SlotRunner(model, slots=len(cases), context=64)
    n = reference["tokens"]
    prompts = [tokenizer.encode(c["prompt"], add_special_tokens=True) for c in cases]
    outs: list[list[int]] = []
    for slot, (case, ids) in enumerate(zip(cases, prompts, strict=True)):
        assert ids == case["prompt_ids"], case["prompt"]  # the count, and the very tokens
        logits = runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([slot]))[0]
        top = torch.tensor(case["top_ids"])
        torch.testing.assert_close(
            logits[top], torch.tensor(case["top_logits"]), rtol=1e-4, atol=1e-3
        )
        outs.append([int(logits.argmax())])
    # then all eight decode together, one row each (a 262k vocabulary: one step per token
    # for the batch costs about what one row's would)
    slots = torch.arange(len(cases))
    for i in range(n - 1):
        last = torch.tensor([[o[-1]] for o in outs])
        pos = torch.tensor([len(ids) + i for ids in prompts])
        step = runner.forward(last, pos, slots)
        for row, o in enumerate(outs):
            o.append(int(step[row].argmax()))
    texts = [tokenizer.decode(o) for o in outs]
    identical = sum(t == c["greedy_text"] for t, c in zip(texts, cases, strict=True))
    assert identical >= 6, f"{identical} of {len(PROMPTS)} greedy texts equal transformers'"
