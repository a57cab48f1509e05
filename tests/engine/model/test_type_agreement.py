"""Agreement floors per GGUF type: the built-in model requantised by the `gguf` package's own
quantizers (tests/engine/model/requantize.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; IQ4_NL by its
own), and the share of
positions at which "auto"'s top-1 token is the same file's float32 one, counted as
bench/bench_fidelity.py counts it (bench_decode.top1_agreement: the 8 parity prompts,
teacher-forced along float32's greedy text). Q8_0 and IQ4_NL take the int8 kind with a scale
per 32 (their own integers); the formats it cannot make (IQ4_XS, K-quants) are held to their
products in test_type_fidelity.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.loader import load_transformer

pytestmark = pytest.mark.skipif(
    packing.native_kernel() is None, reason="needs the native kernel (AVX2 or AVX-512 VNNI)"
)


# Per type, the least share of positions (8 parity prompts x AGREEMENT_POSITIONS, teacher-forced
# along the file's float32 greedy text, as bench/bench_fidelity.py counts them) at which
# "auto"'s top-1 token must be float32's. Measured 2026-12-07 (README's fidelity table has the
# 48-position figures); each floor sits a few positions under what was measured.
AGREEMENT_POSITIONS = 24
AGREEMENT_FLOORS = {
    "Q4_0": 0.97,  # 0.995 (191 of 192); before its own codes 0.807
    "Q4_1": 0.97,  # 0.995
    "Q5_0": 0.96,  # at 48 positions: 0.997
    "Q5_1": 0.96,  # at 48 positions: 0.992
    "Q8_0": 0.99,  # 1.0 (192 of 192) in int8 with a scale per 32; in int8 rows 0.982 (48)
    "IQ4_NL": 0.98,  # 0.995 (191) in int8 per 32; int8 rows 0.958; 4-bit groups 0.755
}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The kernels give the same bits on any number of threads; one wastes no time waiting
    for a busy machine's other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fmt", sorted(AGREEMENT_FLOORS))
def test_auto_agrees_with_float32_on_each_type(
    tmp_path_factory: pytest.TempPathFactory, fmt: str
) -> None:
    from bench.bench_decode import PROMPTS, top1_agreement
    from neuron_trio.engine.gguf.builtin import builtin_model_path
    from neuron_trio.engine.gguf.file import GGUFFile
    from neuron_trio.engine.text.tokenizer import Tokenizer
    from tests.engine.model.requantize import requantize

    source = builtin_model_path()
    path = source if fmt == "Q4_1" else tmp_path_factory.mktemp("fidelity") / f"{fmt}.gguf"
    if fmt != "Q4_1":
        requantize(source, path, fmt)
    with GGUFFile(path) as gf:
        tokenizer = Tokenizer.from_gguf(gf)
    prompts = [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    reference = load_transformer(path, dtype="float32")
    share, count = top1_agreement(
        reference, load_transformer(path, dtype="auto"), prompts, AGREEMENT_POSITIONS
    )
    assert count == len(PROMPTS) * AGREEMENT_POSITIONS
    assert share >= AGREEMENT_FLOORS[fmt], (fmt, share)
