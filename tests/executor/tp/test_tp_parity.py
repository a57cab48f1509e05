"""TP on CPU: the built-in model at tp = 3 over InProcessCommunicator against tp = 1.

Same greedy tokens on a few prompts (token ids directly) and close last-position logits, in
float32 (the reference numerics) and in the CPU's fast `auto` scheme.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from neuron_trio import failpoints as fp
from neuron_trio.errors import SourceError
from neuron_trio.executor.tp.inprocess import InProcessCommunicator
from neuron_trio.executor.tp.sharding import shard_fn
from tests.engine.slot_runner import SlotRunner, slot_tp_runner

pytestmark = pytest.mark.slow

# Token ids of "The capital of France is", "def fibonacci(n):", "Once upon a time" (SmolLM2).
PROMPTS = [[504, 3575, 282, 4649, 314], [1604, 3987, 46477, 24, 94, 727], [6403, 1980, 253, 655]]
CONTEXT = 64


def _builtin() -> Path:
    from neuron_trio.engine.gguf.builtin import builtin_model_path

    try:
        return builtin_model_path()
    except SourceError as exc:
        pytest.skip(str(exc))


def _runners(dtype: str, slots: int = 1):
    from neuron_trio.engine.gguf.file import GGUFFile
    from neuron_trio.engine.model.load.loader import load_transformer

    with GGUFFile(_builtin()) as gguf:
        config = gguf.config
        single = SlotRunner(
            load_transformer(gguf, dtype=dtype, device="cpu"), slots=slots, context=CONTEXT
        )
        shards = [
            load_transformer(gguf, dtype=dtype, device="cpu", shard=shard_fn(config, r, 3), tp=3)
            for r in range(3)
        ]
    comm = InProcessCommunicator(3, failpoints=fp.Failpoints())
    return single, slot_tp_runner(shards, comm, slots=slots, context=CONTEXT, config=config), comm


def _greedy(runner, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor, float]:
    """n greedy tokens after `prompt`; also the prompt's last-position logits, decode seconds."""
    slot = torch.tensor([0])
    logits = runner.forward(torch.tensor([prompt]), torch.tensor([0]), slot)
    first = logits[0].clone()
    tokens = [int(logits[0].argmax())]
    started = time.perf_counter()
    for i in range(n - 1):
        pos = torch.tensor([len(prompt) + i])
        logits = runner.forward(torch.tensor([[tokens[-1]]]), pos, slot)
        tokens.append(int(logits[0].argmax()))
    return tokens, first, time.perf_counter() - started


@pytest.mark.parametrize(
    "dtype, atol, n, prompts", [("float32", 1e-3, 8, PROMPTS), ("auto", 1.0, 4, PROMPTS[:2])]
)
def test_tp3_matches_tp1(dtype: str, atol: float, n: int, prompts: list[list[int]]) -> None:
    single, tp3, comm = _runners(dtype)
    assert tp3.config == single.config
    assert [kv.layers[0].shape[0] for kv in tp3.kv] == [2, 2, 2]  # K and V: one head each
    diffs, t1, t3 = [], 0.0, 0.0
    for prompt in prompts:
        tokens1, logits1, s1 = _greedy(single, prompt, n)
        tokens3, logits3, s3 = _greedy(tp3, prompt, n)
        if dtype == "auto":  # the head's refined candidates; its int4 tail is coarse by design
            top = logits1.topk(64).indices
            logits1, logits3 = logits1[top], logits3[top]
        diffs.append(float((logits1 - logits3).abs().max()))
        t1, t3 = t1 + s1, t3 + s3
        if dtype == "float32":
            assert tokens3 == tokens1, prompt
        else:  # low-precision sums in another order: the first tokens agree
            assert tokens3[:3] == tokens1[:3], prompt
    print(
        f"\n{dtype}: max last-position logit diff {max(diffs):.2e}; decode tok/s "
        f"tp=1 {len(prompts) * (n - 1) / t1:.1f}, tp=3 {len(prompts) * (n - 1) / t3:.1f}"
    )
    assert max(diffs) < atol
    assert comm.all_reduces == 2 * single.config.n_layers * len(prompts) * n


def test_tp3_packed_prefill_matches_tp1_alone() -> None:
    single, tp3, _ = _runners("float32", slots=len(PROMPTS))
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS])  # two rows padded
    lengths = torch.tensor([len(p) for p in PROMPTS])
    starts, slots = torch.zeros(len(PROMPTS), dtype=torch.int64), torch.tensor([2, 0, 1])
    packed = tp3.forward(ids, starts, slots, lengths=lengths)
    for row, prompt in enumerate(PROMPTS):
        alone = single.forward(torch.tensor([prompt]), torch.tensor([0]), torch.tensor([0]))[0]
        assert float((packed[row] - alone).abs().max()) < 1e-3, prompt
