"""Decode speed with a json_schema constraint against none, through the engine, at batch 1 and 8.

    python bench/bench_structured.py [--tokens 48] [--batches 1 8] [--rounds 3]

Every row decodes exactly `--tokens` tokens: free rows with `ignore_eos`, constrained rows
under a schema whose one string must be longer than `--tokens` tokens can fill (so the
grammar never lets them stop early). Decode tokens/s leaves out the prefill steps. The
constrained and free runs alternate, best of `--rounds` each, so machine noise hits both
alike. Two clocks: wall time, and this process's CPU time (all its threads), which other
processes on a shared machine disturb far less. Besides, the grammar's own work (masks
filled and applied, tokens consumed) is timed inside the constrained steps: its share of a
step is the overhead with the least noise. Speed is a ratio measured in one run on one
machine (goal: constrained at most 10% slower).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import neuron_trio.engine.engine as engine_module
from neuron_trio.engine.engine import Engine
from neuron_trio.engine.gguf.builtin import builtin_model_path
from neuron_trio.engine.text.structured.grammar import GrammarState
from neuron_trio.engine.types import Constraint, SamplingParams

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 2000}},
        "required": ["story"],
        "additionalProperties": False,
    }
)
QUESTION = "Tell me a long story about a dragon, as JSON."


class GrammarClock:
    """Times the grammar's work inside engine steps (wrapping the functions the engine calls)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for module, name in ((engine_module, "fill_masks"), (engine_module, "apply_masks")):
            setattr(module, name, self._timed(getattr(module, name)))
        GrammarState.accept = self._timed(GrammarState.accept)  # type: ignore[method-assign]

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def decode_rate(
    engine: Engine, batch: int, tokens: int, constrained: bool, clock: GrammarClock | None = None
) -> tuple[float, float, float]:
    """(tokens/s by wall time, tokens/s by this process's CPU time, grammar share of wall)."""
    prompt = engine.encode_prompt(
        engine.render_chat([{"role": "user", "content": QUESTION}]), chat=True
    )
    constraint = Constraint("json", schema=SCHEMA) if constrained else None
    params = SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=not constrained, constraint=constraint
    )
    for _ in range(batch):
        engine.add(prompt, params, chat=True)
    while any(seq.num_output == 0 for seq in engine.scheduler.sequences):
        engine.step()  # prefill (packed: maybe over two steps) and the first token of each row
    produced = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    grammar_start = clock.seconds if clock is not None else 0.0
    finishes = []
    while engine.has_work:
        events = engine.step()
        produced += sum(len(e.token_ids) for e in events)
        finishes += [e.finish_reason for e in events if e.finish_reason is not None]
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    assert finishes == ["length"] * batch, finishes  # every row ran its `tokens`
    grammar = (clock.seconds - grammar_start) if clock is not None else 0.0
    return produced / elapsed, produced / cpu, grammar / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine = Engine.from_gguf(
        builtin_model_path(),
        dtype=args.dtype,
        device=torch.device("cpu"),
        max_batch=max(args.batches),
        context=1024,
    )
    engine.compile_constraint(Constraint("json", schema=SCHEMA))
    clock = GrammarClock()
    decode_rate(engine, 1, 4, constrained=False)  # warm-up
    for batch in args.batches:
        free, constrained = [], []
        for _ in range(args.rounds):
            free.append(decode_rate(engine, batch, args.tokens, False))
            constrained.append(decode_rate(engine, batch, args.tokens, True, clock))
        wall_free, wall_json = max(r[0] for r in free), max(r[0] for r in constrained)
        cpu_free, cpu_json = max(r[1] for r in free), max(r[1] for r in constrained)
        share = min(r[2] for r in constrained)
        print(
            f"batch {batch}: wall: free {wall_free:.1f} tok/s, json_schema {wall_json:.1f} tok/s "
            f"({100 * (1 - wall_json / wall_free):+.1f}% slower); "
            f"CPU time: free {cpu_free:.1f}, json_schema {cpu_json:.1f} tok/s "
            f"({100 * (1 - cpu_json / cpu_free):+.1f}% slower); "
            f"grammar work {100 * share:.1f}% of the constrained steps"
        )


if __name__ == "__main__":
    main()
