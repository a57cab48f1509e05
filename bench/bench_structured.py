"""Decode speed with a json_schema constraint against none, through the engine, at batch 1 and 8.

    python bench/bench_structured.py [--tokens 48] [--batches 1 8] [--rounds 3]

Every row decodes exactly `--tokens` tokens: free rows with `ignore_eos`, constrained rows
under a schema whose one string must be longer than `--tokens` tokens can fill (so the
grammar never lets them stop early). Decode tokens/s leaves out the prefill step: tokens
after the first over the time of the steps after the first. The constrained and free runs
alternate, best of `--rounds` each, so machine noise hits both alike. Speed is a ratio
measured in one run on one machine (goal: constrained at most 10% slower).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_trio.engine.builtin import builtin_model_path
from neuron_trio.engine.engine import Engine
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


def decode_rate(engine: Engine, batch: int, tokens: int, constrained: bool) -> float:
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
    start = time.perf_counter()
    finishes = []
    while engine.has_work:
        events = engine.step()
        produced += sum(len(e.token_ids) for e in events)
        finishes += [e.finish_reason for e in events if e.finish_reason is not None]
    elapsed = time.perf_counter() - start
    assert finishes == ["length"] * batch, finishes  # every row ran its `tokens`
    return produced / elapsed


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
    decode_rate(engine, 1, 4, constrained=False)  # warm-up
    for batch in args.batches:
        free, constrained = [], []
        for _ in range(args.rounds):
            free.append(decode_rate(engine, batch, args.tokens, constrained=False))
            constrained.append(decode_rate(engine, batch, args.tokens, constrained=True))
        best_free, best_constrained = max(free), max(constrained)
        slower = 100 * (1 - best_constrained / best_free)
        print(
            f"batch {batch}: free {best_free:.1f} tok/s, json_schema {best_constrained:.1f} tok/s "
            f"({slower:+.1f}% slower)"
        )


if __name__ == "__main__":
    main()
