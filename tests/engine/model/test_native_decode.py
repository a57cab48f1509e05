"""The decode layers' native loop (engine/model/native_decode.py, `decode_layers` in
_cpu_layers.c) against the Python path through the same kernels: the same logits, bit for bit,
on every family it takes; and the steps and models it leaves to Python."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_trio.engine.block_pool import BLOCK_TOKENS, NULL_BLOCK
from neuron_trio.engine.model import native_decode, placement
from neuron_trio.engine.model import transformer as transformer_module
from neuron_trio.engine.model.linear import Q8Linear
from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.loader import load_transformer
from neuron_trio.engine.model.transformer import Transformer
from tests.engine.model.kernel_isas import ALL_ISAS, isa_fixture
from tests.engine.slot_runner import SlotRunner
from tests.engine.tiny_families import write_tiny_family

pytestmark = pytest.mark.skipif(
    packing.native_kernel() is None, reason="the native kernel is not built on this machine"
)

# Real Q4_K_M files mix formats: a fused Q/K/V of two kernels, an int8 down projection.
MIXED = {"attn_v.weight": "Q8_0", "ffn_down.weight": "Q8_0"}


@pytest.fixture(params=ALL_ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from isa_fixture(request)


def tiny(tmp_path: Path, family: str) -> Path:
    return write_tiny_family(tmp_path / f"{family}.gguf", family, qtype="Q4_1", qtypes=MIXED)


class CountingPlan:
    """Counts the steps the loop ran (its `run` answered) and the ones it left to Python."""

    def __init__(self, model: Transformer) -> None:
        plan = native_decode.plan_for(model)
        assert plan is not None
        self.ran = self.declined = 0
        run = plan.run

        def counted(*args: Any) -> torch.Tensor | None:
            out = run(*args)
            if out is None:
                self.declined += 1
            else:
                self.ran += 1
            return out

        plan.run = counted  # type: ignore[method-assign]


def python_path(path: Path) -> Transformer:
    model = load_transformer(path, dtype="auto")
    model._decode_plan = None  # see native_decode.plan_for
    return model


def decode_both(
    path: Path, prompts: list[list[int]], steps: int, *, scattered: bool, context: int = 64
) -> tuple[list[torch.Tensor], list[torch.Tensor], CountingPlan]:
    """The same prefill and greedy decode steps through both paths: each step's logits."""
    models = [python_path(path), load_transformer(path, dtype="auto")]
    counting = CountingPlan(models[1])
    out: list[list[torch.Tensor]] = [[], []]
    for model, logits in zip(models, out, strict=True):
        runner = SlotRunner(model, slots=len(prompts), context=context, scattered=scattered)
        slots = torch.arange(len(prompts))
        last = []
        for i, p in enumerate(prompts):
            row = runner.forward(torch.tensor([p]), torch.tensor([0]), slots[i : i + 1])
            last.append(int(row.argmax()))
        pos = torch.tensor([len(p) for p in prompts])
        for step in range(steps):
            step_logits = runner.forward(torch.tensor([[t] for t in last]), pos + step, slots)
            logits.append(step_logits)
            last = step_logits.argmax(dim=-1).tolist()
    return out[0], out[1], counting


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "gemma3", "phi3"])
@pytest.mark.parametrize(("rows", "scattered"), [(1, False), (3, True)])
def test_the_loop_gives_the_python_paths_bits(
    tmp_path: Path, family: str, rows: int, scattered: bool
) -> None:
    # rows of different lengths (an additive mask), short enough that gemma3's window of 8
    # masks nothing
    prompts = [[5 + i, 9, 12 + i, 7][: 2 + i] for i in range(rows)]
    python, native, counting = decode_both(tiny(tmp_path, family), prompts, 4, scattered=scattered)
    assert counting.ran == 4 and counting.declined == 0
    for a, b in zip(python, native, strict=True):
        assert torch.equal(a, b)


def test_either_instruction_set_the_same_bits_as_its_python_path(tmp_path: Path, isa: str) -> None:
    prompts = [[5, 9, 12], [6, 9], [7, 3, 4, 8]]
    python, native, _ = decode_both(tiny(tmp_path, "qwen2"), prompts, 3, scattered=True)
    for a, b in zip(python, native, strict=True):
        assert torch.equal(a, b)


def test_a_sliding_window_that_masks_keys_the_same_bits(tmp_path: Path) -> None:
    # rows past gemma3's window of 8 (an additive window mask on its sliding layers), one not
    prompts = [[5, 9, 12, 7, 3, 4, 8, 10, 11], [6, 9]]
    python, native, counting = decode_both(tiny(tmp_path, "gemma3"), prompts, 4, scattered=True)
    assert counting.ran == 4 and counting.declined == 0
    for a, b in zip(python, native, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_short_row_beside_a_long_one_the_same_bits(tmp_path: Path, family: str) -> None:
    # the short row reads only its own keys (row_keys: 8 of the long row's 36), the Python
    # path all 36 under the mask; gemma3's window of 8 masks the long row's early keys too
    prompts = [[5, 9, 12], [5 + (7 * i) % 90 for i in range(33)]]
    python, native, counting = decode_both(tiny(tmp_path, family), prompts, 4, scattered=True)
    assert counting.ran == 4 and counting.declined == 0
    for a, b in zip(python, native, strict=True):
        assert torch.equal(a, b)


def test_no_row_reads_keys_past_its_end(tmp_path: Path, isa: str) -> None:
    # Keys past a row's end are the null block's. Poisoned with NaN there, a row that read
    # them would get NaN (0 x NaN) even under the mask; the short row (7 tokens, then its
    # 8th: a whole chunk of 8 keys) reads none of them, the long one has none to read.
    model = load_transformer(tiny(tmp_path, "qwen2"), dtype="auto")
    runner = SlotRunner(model, slots=2, context=64, scattered=True)
    prompts = [[5, 9, 12, 7, 3, 4, 8], [5 + (7 * i) % 90 for i in range(30)]]
    last = []
    for slot, prompt in enumerate(prompts):
        row = runner.forward(torch.tensor([prompt]), torch.tensor([0]), torch.tensor([slot]))
        last.append([int(row.argmax())])
    at = torch.tensor([len(p) for p in prompts])
    clean = runner.forward(torch.tensor(last), at, torch.arange(2))
    null = NULL_BLOCK * BLOCK_TOKENS
    runner.kv.storage[:, :, null : null + BLOCK_TOKENS] = float("nan")
    poisoned = runner.forward(torch.tensor(last), at, torch.arange(2))
    assert torch.isfinite(clean).all() and torch.equal(poisoned, clean)
    model._decode_plan = None  # the Python path reads every key, the mask zeroing them
    assert torch.isnan(runner.forward(torch.tensor(last), at, torch.arange(2))[0]).any()


def test_sliding_layers_from_the_window_start_the_bits_of_attending_from_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rows at 137 and 140 tokens: gemma3's sliding layers (window 8) attend from position 128
    # on (Placement.window_start, a multiple of WINDOW_ALIGN), in both paths
    path = tiny(tmp_path, "gemma3")
    prompts = [[5 + (7 * i) % 90 for i in range(140)], [5 + (5 * i) % 90 for i in range(137)]]
    starts: list[int] = []
    attend_decode = transformer_module.attend_decode

    def recorded(*args: Any) -> torch.Tensor:
        starts.append(args[-1])
        return attend_decode(*args)

    monkeypatch.setattr(transformer_module, "attend_decode", recorded)
    python, native, counting = decode_both(path, prompts, 3, scattered=True, context=160)
    assert counting.ran == 3 and counting.declined == 0
    assert set(starts) == {0, 128}  # the global layers from 0, the sliding ones from 128
    monkeypatch.setattr(placement, "WINDOW_ALIGN", 1 << 20)  # every layer from 0
    starts.clear()
    python_0, native_0, _ = decode_both(path, prompts, 3, scattered=True, context=160)
    assert set(starts) == {0}
    for a, b, c, d in zip(python, native, python_0, native_0, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(b, d)


def test_models_it_does_not_take(tmp_path: Path) -> None:
    gemma2 = load_transformer(tiny(tmp_path, "gemma2"), dtype="auto")  # soft-capped scores
    assert native_decode.plan_for(gemma2) is None
    dense = load_transformer(tiny(tmp_path, "llama3"), dtype="float32")  # no native kernel
    assert native_decode.plan_for(dense) is None


def test_the_kernels_parts_agree_with_torch() -> None:
    kernel = packing.native_kernel()
    torch.manual_seed(0)
    x, src, w = torch.randn(3, 64), torch.randn(3, 64).bfloat16(), torch.rand(64) + 0.5
    out = torch.empty_like(x)
    kernel.norm_add(x.data_ptr(), src.data_ptr(), 1, 3, 64, w.data_ptr(), 1e-6, out.data_ptr())
    want = x + torch.nn.functional.rms_norm(src.float(), (64,), w, 1e-6)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)
    kernel.norm_add(x.data_ptr(), src.data_ptr(), 1, 3, 64, 0, 0.0, out.data_ptr())
    assert torch.equal(out, x + src.float())  # one float32 add: exact
    # without x: RMSNorm alone (the final norm), float32 in
    kernel.norm_add(0, x.data_ptr(), 0, 3, 64, w.data_ptr(), 1e-6, out.data_ptr())
    assert torch.allclose(
        out, torch.nn.functional.rms_norm(x, (64,), w, 1e-6), rtol=1e-5, atol=1e-6
    )


def test_the_final_norm_in_the_kernel_is_torchs(tmp_path: Path) -> None:
    model = load_transformer(tiny(tmp_path, "llama3"), dtype="auto", device="cpu")
    assert model.native_kernel is not None
    torch.manual_seed(0)
    x = torch.randn(2, 3, model.config.dim) * 4
    want = torch.nn.functional.rms_norm(x, (model.config.dim,), model.norm, model.config.rms_eps)
    got = model._final_norm(x)
    assert got.shape == x.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, x)  # it normed
    model.native_kernel = None  # torch's, bit for bit
    assert torch.equal(model._final_norm(x), want)


def test_int8_layers_swiglu_of_bfloat16_rounds_as_torchs_did() -> None:
    # The int8 layers' SwiGLU ran in torch before the kernel took it; agreement with float32
    # was measured that way, so the kernel rounds SiLU(gate) and its product to bfloat16.
    kernel = packing.native_kernel()
    torch.manual_seed(0)
    weight, scale = packing.pack_q8(torch.randn(64, 128))
    layer = Q8Linear(kernel, weight, scale, keep_dtype=True)
    gate_up = torch.randn(5, 256).bfloat16()
    fused = layer.gated(gate_up, False)
    in_torch = layer.forward(torch.nn.functional.silu(gate_up[:, :128]) * gate_up[:, 128:])
    assert torch.equal(fused, in_torch)
