"""The counting parts of bench/batch_ceiling.py: the products a decoded row costs the kernels
(two int8 passes for 4-bit weights, one for the head's coarse pass), the table's steps, and
the dot peak's harness."""

from __future__ import annotations

import shutil

import pytest

from bench import batch_ceiling
from neuron_trio.engine.model.load import packing


def test_a_tables_steps_are_the_medians_as_step_seconds() -> None:
    table = {
        "models": {
            "m": {
                "runs": {
                    "decode_1": {"neuron": [250.0, 200.0, 400.0], "llamacpp": [1.0]},
                    "decode_8": {"neuron": [800.0, 1000.0, 600.0]},
                }
            }
        }
    }
    steps = batch_ceiling.measured_steps(table, "m")
    assert steps is not None
    one, eight = steps
    assert one == pytest.approx(1 / 250)
    assert eight == pytest.approx(8 / 800)  # 8 rows a step at 800 tok/s
    assert batch_ceiling.measured_steps(table, "other") is None
    assert batch_ceiling.measured_steps({}, "m") is None


@pytest.mark.slow
@pytest.mark.skipif(packing.native_kernel() is None, reason="the native kernel is not built here")
def test_the_built_in_models_row_costs_two_passes_a_layer_and_one_for_the_head() -> None:
    from neuron_trio.engine.gguf.builtin import builtin_model_path
    from neuron_trio.engine.model.load.loader import load_transformer

    model = load_transformer(builtin_model_path(), dtype="auto")
    c = model.config
    qkv = c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    out = c.n_heads * c.head_dim * c.dim
    ffn = 3 * c.dim * c.ffn_dim  # gate, up and down
    work = batch_ceiling.step_work(model)
    # every layer's weights are Q4_1: two passes; the tied head's coarse pass: one
    assert work.products == 2 * c.n_layers * (qkv + out + ffn) + c.vocab_size * c.dim
    assert work.uncounted == ()
    assert work.bytes > c.n_layers * (qkv + out + ffn) // 2  # at least 4 bits a weight


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_dot_peak_harness_compiles_runs_and_names_its_instructions() -> None:
    rate, isa = batch_ceiling.dot_peak(1)
    assert isa in ("avx512vnni", "avx2", "none")
    assert (rate > 1e9) == (isa != "none")  # any x86 core of this century: > 1 G products/s
