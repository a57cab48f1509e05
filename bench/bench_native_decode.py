"""The decode layers' native loop (engine/model/native_decode.py) against the Python path
through the same kernels, in one process, rounds interleaved: step times at batch 1 and at 8
streams, and where a native step's time goes (the layers' one call, the output head, the
rest: sampling, scheduling, the engine's bookkeeping).

    python bench/bench_native_decode.py [--model smollm2|gemma3|qwen2.5-0.5b] [--rounds 3]

Batch 1: (T(n) - T(1)) / (n - 1) of one sequence, as bench_table.py measures it; 8 streams:
the steps after all 8 prompts have their first token (table_neuron.py's `streams`). Each
figure is the best of its rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.prompts import PROMPTS  # noqa: E402
from bench.table_models import MODELS  # noqa: E402
from bench.table_neuron import NeuronSide, greedy  # noqa: E402
from neuron_trio.engine.model import native_decode  # noqa: E402


def step_times(side: NeuronSide, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """Seconds a step at batch 1 and at len(prompts) streams."""
    t_n = min(side._run(prompts[0], tokens) for _ in range(2))
    t_1 = min(side._run(prompts[0], 1) for _ in range(2))
    streams = side.streams(prompts, tokens)
    return (t_n - t_1) / (tokens - 1), streams["seconds"] / (streams["tokens"] / len(prompts))


def breakdown(side: NeuronSide, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    """Milliseconds a native step spends in the layers' call, the head, and the rest."""
    spent: defaultdict[str, float] = defaultdict(float)
    model: Any = side.engine.runner.model  # type: ignore[attr-defined]
    plan = native_decode.plan_for(model)
    if plan is None:
        return {}
    run, head = plan.run, model.output.forward

    def timed(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args)
            spent[name] += time.perf_counter() - start
            return out

        return call

    plan.run, model.output.forward = timed("layers", run), timed("head", head)  # type: ignore[method-assign]
    try:
        engine = side.engine
        for p in prompts:
            engine.add(p, greedy(tokens), chat=False)
        engine.step()  # the prompts' prefill
        spent.clear()
        steps, start = 0, time.perf_counter()
        while engine.has_work:
            engine.step()
            steps += 1
        total = time.perf_counter() - start
    finally:
        plan.run, model.output.forward = run, head  # type: ignore[method-assign]
    out = {name: seconds / steps * 1e3 for name, seconds in spent.items()}
    out["rest"] = total / steps * 1e3 - sum(out.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    side = NeuronSide(str(MODELS[args.model].resolve()), 2304, 8)
    model: Any = side.engine.runner.model  # type: ignore[attr-defined]
    prompts = side.encode(list(PROMPTS[:8]))["ids"]
    side._run(prompts[0], 4)
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for path in ("python", "native"):
            model._decode_plan = None if path == "python" else False  # see plan_for
            one, eight = step_times(side, prompts, args.tokens)
            for batch, seconds in ((1, one), (8, eight)):
                best[path, batch] = min(best.get((path, batch), seconds), seconds)
    for path in ("python", "native"):
        one, eight = best[path, 1], best[path, 8]
        print(
            f"{args.model} {path:6}: batch 1 {one * 1e3:.2f} ms/step ({1 / one:.1f} tok/s), "
            f"8 streams {eight * 1e3:.2f} ms/step ({8 / eight:.1f} tok/s, {8 * one / eight:.2f}x)"
        )
    print(f"native over python at batch 1: {best['python', 1] / best['native', 1]:.2f}x")
    model._decode_plan = False
    for batch in (1, 8):
        parts = breakdown(side, prompts[:batch], args.tokens)
        print(
            f"native step at batch {batch}: "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items())
        )


if __name__ == "__main__":
    main()
