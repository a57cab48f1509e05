"""The engine against Hugging Face transformers on the built-in GGUF file (float32 both sides).

transformers dequantises the same file to float32 and un-permutes Q/K itself, so it is an
independent reference for the reader, the dequantisers and the model. Input ids come from
transformers' tokenizer, so this test does not depend on ours. Slow: loads the model twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from neuron_trio.engine.model.load.loader import load_transformer
from neuron_trio.engine.model.transformer import Transformer
from tests.engine.hf_reference import load_hf_reference
from tests.engine.slot_runner import SlotRunner

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
]
EOS = 2


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Any, Any, Transformer]]:
    hf, tok, path = load_hf_reference()
    ours = load_transformer(path, dtype="float32", device="cpu")
    yield hf, tok, ours


def ids_of(tok: Any, text: str, *, chat: bool = False) -> list[int]:
    if chat:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tok(text).input_ids)


def our_greedy(runner: SlotRunner, prompt: list[int], n: int, slot: int = 0) -> list[int]:
    logits = runner.forward(torch.tensor([prompt]), torch.tensor([0]), torch.tensor([slot]))
    out = [int(logits[0].argmax())]
    while len(out) < n and out[-1] != EOS:
        pos = torch.tensor([len(prompt) + len(out) - 1])
        logits = runner.forward(torch.tensor([[out[-1]]]), pos, torch.tensor([slot]))
        out.append(int(logits[0].argmax()))
    return out


def test_last_position_logits_match(pair: tuple[Any, Any, Transformer]) -> None:
    hf, tok, ours = pair
    runner = SlotRunner(ours, slots=1, context=256)
    worst = 0.0
    for text in PROMPTS:
        ids = ids_of(tok, text)
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0, -1].float()
        got = runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]))[0]
        diff = (got - want).abs().max().item()
        scale = want.abs().max().item()
        worst = max(worst, diff / scale)
        print(f"{text!r}: max |diff| {diff:.2e} at logit scale {scale:.1f}")
        assert diff <= 1e-4 * scale, (text, diff, scale)
        assert int(got.argmax()) == int(want.argmax())
    print(f"worst relative logit difference {worst:.2e}")


@pytest.mark.parametrize(
    ("text", "chat"),
    [("What is the capital of France?", True), ("def fibonacci(n):", False), (PROMPTS[2], False)],
)
def test_greedy_48_tokens_identical(
    pair: tuple[Any, Any, Transformer], text: str, chat: bool
) -> None:
    hf, tok, ours = pair
    ids = ids_of(tok, text, chat=chat)
    n = 48
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    want = out[0, len(ids) :].tolist()
    runner = SlotRunner(ours, slots=1, context=len(ids) + n + 1)
    got = our_greedy(runner, ids, n)
    assert got == want, tok.decode(got) + " | " + tok.decode(want)
    if chat:
        assert "Paris" in tok.decode(got)


def test_batch_of_8_matches_alone_on_builtin(pair: tuple[Any, Any, Transformer]) -> None:
    _, tok, ours = pair
    prompts = [ids_of(tok, t) for t in PROMPTS] + [ids_of(tok, t, chat=True) for t in PROMPTS]
    n = 12
    runner = SlotRunner(ours, slots=9, context=128)
    alone = [our_greedy(runner, p, n, slot=8) for p in prompts]
    slots = [6, 1, 4, 0, 2, 7, 3, 5]
    tokens = [
        [int(runner.forward(torch.tensor([p]), torch.tensor([0]), torch.tensor([s])).argmax())]
        for p, s in zip(prompts, slots, strict=True)
    ]
    pos = torch.tensor([len(p) for p in prompts])
    for i in range(n - 1):
        logits = runner.forward(
            torch.tensor([[t[-1]] for t in tokens]), pos + i, torch.tensor(slots)
        )
        for row, t in zip(logits, tokens, strict=True):
            t.append(int(row.argmax()))
    # our_greedy stops at EOS; compare each row up to its own end.
    for got, want in zip(tokens, alone, strict=True):
        assert got[: len(want)] == want
