"""How far 8 streams can pull ahead of one on this machine: the ratio of their decode rates
when each runs at the machine's limit, next to the ratio the README's table measured.

    python bench/batch_ceiling.py [--models smollm2,gemma3,qwen2.5-0.5b] [--threads 2]
                                  [--table bench/results/bench-table.json]

A decode step at batch 1 reads every weight once and does little arithmetic on each: its
limit is memory bandwidth (bench/roofline.py). At batch 8 the same bytes feed 8 times the
arithmetic. neuron's kernel multiplies 4- and 5-bit weights by int8 activations in two passes
(the activations and their residual, ~15 bits: what keeps greedy output in agreement with
float32; the output head's coarse pass takes one) and int8 weights in one, every product an
integer `vpdpbusd` lane. So batch 8 can be no faster than its products at the instruction's
peak rate (bench/dot_peak.c, measured here), nor than reading the weights:

    floor(1) = max(bytes / bandwidth, products / peak)
    floor(8) = max(bytes / bandwidth, 8 · products / peak)
    ceiling  = 8 · floor(1) / floor(8)         (aggregate tok/s at 8 over tok/s at 1)

The floors leave out attention, norms, the sampler and the glue between kernels. A measured
ratio passes the ceiling only as far as batch 8 runs closer to its floor than batch 1 does
to its own. "4x" needs a batch-8 step of at most twice batch 1's: given the other's measured
step, the last two columns say how close to its floor batch 1 may come at most, and how
close to its floor batch 8 must come at least.

The bandwidth is the table's own (measured in the same run as its steps: this shared
machine's varies by 2x over a day), or measured now when there is no table or with
`--bandwidth-now`. The dot peak is measured now.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import table_format  # noqa: E402
from bench.roofline import decode_weight_bytes, stream_bandwidth  # noqa: E402
from bench.table_models import MODELS  # noqa: E402
from neuron_trio.engine.model.linear import Q4Linear, Q8Linear  # noqa: E402
from neuron_trio.engine.model.load.loader import load_transformer  # noqa: E402

STREAMS = 8
HEADER = (
    "Model", "MB read a row", "M products a row", "floor, batch 1 (ms)", "floor, batch 8 (ms)",
    "ceiling: 8 streams / 1", "measured (table)", "batch 1 at most, for 4× (% of its floor)",
    "batch 8 at least, for 4× (% of its floor)",
)  # fmt: skip
ONE_PASS = 8  # Q4Linear's flag for the kernel's FLAG_ONE_PASS (the head's coarse pass)


def dot_peak(threads: int) -> tuple[float, str]:
    """Integer products per second of `threads` threads at the dot instruction's peak, and
    the instruction set: bench/dot_peak.c, compiled here with the C compiler ($CC or cc)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or "gcc"
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "dot_peak"
        source = Path(__file__).with_name("dot_peak.c")
        subprocess.run([compiler, "-O2", "-fopenmp", str(source), "-o", str(binary)], check=True)
        out = subprocess.run(
            [str(binary), str(threads)], check=True, capture_output=True, text=True
        )
    rate, isa, _ = out.stdout.split()
    return float(rate), isa


@dataclass(frozen=True)
class StepWork:
    """What one decoded row costs the kernels: weight bytes read, integer products."""

    bytes: int
    products: int
    uncounted: tuple[str, ...]  # linear layers outside the int kernels (their work left out)


def step_work(model: nn.Module) -> StepWork:
    """The products of every linear layer of the blocks and the head for one row: in · out
    per pass, two passes for 4/5-bit weights (one for the head's coarse pass), one for int8."""
    products, uncounted = 0, []
    parts: list[nn.Module] = [model.layers, model.output]  # type: ignore[list-item]
    for part in parts:
        for name, module in part.named_modules():
            size = getattr(module, "in_features", 0) * getattr(module, "out_features", 0)
            if isinstance(module, Q4Linear):
                products += size * (1 if module._flags & ONE_PASS else 2)
            elif isinstance(module, Q8Linear):
                products += size
            elif not list(module.children()) and size:
                uncounted.append(f"{name} ({type(module).__name__})")
    return StepWork(decode_weight_bytes(model), products, tuple(uncounted))


def read_table(path: Path) -> dict[str, Any]:
    """bench_table.py's raw runs, or {} without them."""
    return json.loads(path.read_text()) if path.is_file() else {}


def measured_steps(table: dict[str, Any], key: str) -> tuple[float, float] | None:
    """Seconds a step at batch 1 and at batch 8 from bench_table.py's raw runs (medians)."""
    runs = table.get("models", {}).get(key, {}).get("runs", {})
    one = table_format.median(runs.get("decode_1", {}).get("neuron", []))
    eight = table_format.median(runs.get("decode_8", {}).get("neuron", []))
    if not one or not eight:
        return None
    return 1 / one, STREAMS / eight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--table", type=Path, default=REPO / "bench/results/bench-table.json")
    parser.add_argument("--bandwidth-now", action="store_true", help="not the table's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    table = read_table(args.table)
    peak, isa = dot_peak(args.threads)
    bandwidth = table.get("bandwidth", {}).get(str(args.threads))
    where = f"the table's, {table.get('meta', {}).get('date', '?')}"
    if bandwidth is None or args.bandwidth_now:
        bandwidth, where = stream_bandwidth(args.threads, repeats=10), "now"
    print(
        f"{args.threads} threads: dot peak {peak / 1e9:.0f} G int8 products/s ({isa}, now), "
        f"streaming read {bandwidth / 1e9:.1f} GB/s ({where})\n"
    )
    rows: list[list[str]] = []
    notes: list[str] = []
    for key in args.models.split(","):
        work = step_work(load_transformer(MODELS[key].resolve(), dtype="auto"))
        memory = work.bytes / bandwidth
        floor1 = max(memory, work.products / peak)
        floor8 = max(memory, STREAMS * work.products / peak)
        ceiling = STREAMS * floor1 / floor8
        row = [
            MODELS[key].label, f"{work.bytes / 1e6:.1f}", f"{work.products / 1e6:.0f}",
            f"{floor1 * 1e3:.2f}", f"{floor8 * 1e3:.2f}", f"{ceiling:.2f}×",
        ]  # fmt: skip
        steps = measured_steps(table, key)
        if steps is None:
            row += ["-", "-", "-"]
        else:
            one, eight = steps
            # 4x: eight <= 2 * one. Batch 1 may be no faster than eight / 2 (a share of its
            # floor); batch 8 must take at most 2 * one (its floor's share of that).
            row += [
                f"{STREAMS * one / eight:.2f}×",
                f"{100 * min(1.0, floor1 / (eight / 2)):.0f}%",
                f"{100 * floor8 / (2 * one):.0f}%",
            ]
        rows.append(row)
        if work.uncounted:
            notes.append(
                f"{key}: not counted, outside the int kernels: {', '.join(work.uncounted)}"
            )
    print(table_format.markdown_table(HEADER, rows, "lrrrrrrrr"))
    for note in notes:
        print(f"  ({note})")


if __name__ == "__main__":
    main()
