"""Tensor parallelism per model family: tp ranks on the CPU (in-process communicator) against
one unsharded model, through the real sharding rules and TPRunner; KV heads replicated when
tp is a multiple of them; refusals name the numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.load.loader import load_transformer
from neuron_trio.errors import ConfigError
from neuron_trio.executor.tp.inprocess import InProcessCommunicator
from neuron_trio.executor.tp.sharding import check_tp, rank_shapes, shard_fn
from tests.engine.slot_runner import SlotRunner, slot_tp_runner
from tests.engine.tiny_families import FAMILIES, write_tiny_family


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("families_tp")
    for family in FAMILIES:
        write_tiny_family(d / f"{family}.gguf", family)
    return d


def run_both(path: Path, tp: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(unsharded, tp ranks) logits for: a 20-token prompt, 4 decode steps, a packed pair."""
    with GGUFFile(path) as gf:
        config = gf.config
        whole = load_transformer(gf, dtype="float32", device="cpu")
        ranks = [
            load_transformer(
                gf, dtype="float32", device="cpu", shard=shard_fn(config, r, tp), tp=tp
            )
            for r in range(tp)
        ]
    single = SlotRunner(whole, slots=3, context=64)
    runner = slot_tp_runner(ranks, InProcessCommunicator(tp), slots=3, context=64, config=config)
    ids = np.random.default_rng(4).integers(10, config.vocab_size, size=20).tolist()
    outs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for r, out in ((single, outs[0]), (runner, outs[1])):
        out.append(
            r.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), all_logits=True)
        )
        token = int(out[-1][0, -1].argmax())
        for i in range(4):
            out.append(
                r.forward(torch.tensor([[token]]), torch.tensor([20 + i]), torch.tensor([0]))
            )
            token = int(out[-1].argmax())
        # two prompts packed, one padded: rows of 12 and 5 tokens in slots 1 and 2
        batch = torch.tensor([ids[:12], ids[3:8] + [0] * 7])
        out.append(
            r.forward(
                batch, torch.tensor([0, 0]), torch.tensor([1, 2]), lengths=torch.tensor([12, 5])
            )
        )
    return outs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_equals_one_model(family_dir: Path, family: str) -> None:
    whole, sharded = run_both(family_dir / f"{family}.gguf", 2)
    for a, b in zip(whole, sharded, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_kv_heads_replicated_when_tp_exceeds_them(family_dir: Path, family: str) -> None:
    """4 heads, 2 KV heads, tp = 4: each rank holds one query head and a copy of its KV head."""
    path = family_dir / f"{family}.gguf"
    with GGUFFile(path) as gf:
        config = gf.config
    assert (config.n_heads, config.n_kv_heads) == (4, 2)
    assert rank_shapes(config, 4) == [{"heads": 1, "kv_heads": 1}] * 4
    whole, sharded = run_both(path, 4)
    for a, b in zip(whole, sharded, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_tp_refusals_name_the_numbers(family_dir: Path) -> None:
    with GGUFFile(family_dir / "qwen2.gguf") as gf:
        config = gf.config
    with pytest.raises(ConfigError, match=r"tp = 3 does not divide 4 attention heads / 2 KV heads"):
        check_tp(config, 3)
    with pytest.raises(ConfigError, match=r"tp = 8 does not divide 4 attention heads"):
        check_tp(config, 8)
    three_kv = config.__class__(
        **{**config.__dict__, "n_heads": 6, "n_kv_heads": 3, "ffn_dim": 126}
    )
    check_tp(three_kv, 3)
    with pytest.raises(ConfigError, match=r"not a multiple of the 3 KV heads"):
        check_tp(three_kv, 2)  # 6 heads split, but 3 KV heads neither split nor replicated
