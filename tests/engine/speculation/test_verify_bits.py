"""A speculative verification's rows (engine/speculation/speculative.py `verify`: the last
token and its draft as k + 1 decode rows of one forward) give each position the logits that
decoding it alone gives, bit for bit, on the native kernel's every instruction set: greedy
output with speculation is then the output without it, token for token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from neuron_trio.engine.block_pool import RESERVED_BLOCKS
from neuron_trio.engine.gguf.builtin import builtin_model_path
from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.loader import SingleRunner, load_transformer
from neuron_trio.engine.model.transformer import Transformer
from tests.engine.model.kernel_isas import ALL_ISAS, isa_fixture
from tests.engine.tiny_families import write_tiny_family

pytestmark = pytest.mark.skipif(
    packing.native_kernel() is None, reason="the native kernel is not built on this machine"
)
BLOCKS = 6
TABLE = list(range(RESERVED_BLOCKS, RESERVED_BLOCKS + BLOCKS))


@pytest.fixture(params=ALL_ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from isa_fixture(request)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    path = tmp_path_factory.mktemp("verify") / "qwen2.gguf"
    write_tiny_family(path, "qwen2", qtype="Q4_1", qtypes={"ffn_down.weight": "Q8_0"})
    return load_transformer(path, dtype="auto")


@pytest.fixture(scope="module")
def builtin_model() -> Transformer:
    return load_transformer(builtin_model_path(), dtype="auto")


def _forward(runner: SingleRunner, tokens: list[int], start: int) -> torch.Tensor:
    """`tokens` as decode rows at start, start + 1, ... on one sequence's blocks, as verify
    lays them out: the logits `[len(tokens), V]`."""
    return runner.forward(
        torch.tensor(tokens)[:, None],
        torch.arange(start, start + len(tokens)),
        torch.tensor([TABLE] * len(tokens)),
    )


def _rows_that_differ(model: Transformer, prompt_lengths: range) -> list[tuple[int, int]]:
    """(prompt length, row) of each verification row whose logits are not, bit for bit, the
    ones of decoding its token alone at its position after the same tokens."""
    runner = SingleRunner(model, blocks=RESERVED_BLOCKS + BLOCKS, context=BLOCKS * 16)
    prompt = [3 + (7 * i) % 90 for i in range(prompt_lengths.stop)]
    runner.forward(torch.tensor([prompt]), torch.tensor([0]), torch.tensor([TABLE]))
    differ = []
    for n in prompt_lengths:  # each n: the cache's first n positions are the prefix
        draft = [prompt[n - 1], 11, 42, 7, 19, 64]
        together = _forward(runner, draft, n)
        alone = torch.cat([_forward(runner, [t], n + j) for j, t in enumerate(draft)])
        differ += [(n, j) for j in range(len(draft)) if not torch.equal(together[j], alone[j])]
    assert model._decode_plan, "the native decode loop took the steps"
    return differ


def test_verify_rows_give_one_row_decodings_bits_on_the_builtin_model(
    builtin_model: Transformer,
) -> None:
    # Rows whose ends are not multiples of 8 beside longer ones: the attention's softmax sum
    # once rounded otherwise for a row with masked keys after its own (rows of 3 of these 8
    # prompt lengths differed, on every instruction set, and greedy answers parted:
    # bench_speculative.py --parity). The built-in model: bfloat16 activations over 30 layers
    # turn such a float32 rounding into other bits where a tiny model's rarely do. The
    # kernel's default instruction set (each one's attention: test_cpu_kernel.py).
    assert _rows_that_differ(builtin_model, range(33, 41)) == []


def test_verify_rows_give_one_row_decodings_bits_on_a_tiny_model(
    tiny_model: Transformer, isa: str
) -> None:
    assert _rows_that_differ(tiny_model, range(9, 60)) == []
