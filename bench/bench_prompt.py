"""A request's way in, per request, in process CPU time: its prompt prepared and added, and a
Responses API body parsed into its chat job.

    python bench/bench_prompt.py [--requests 2000] [--rounds 5]

`prepare+add`: the built-in model's engine (devices = "cpu") prepares a small chat
(`Engine.prepare`: template, tokenise, check) and adds the `PreparedPrompt`, then cancels it
(no step runs): what the model actor does for each request on arrival and admission.
`responses parse`: a Responses body of 8 input items and a function tool, parsed into its
chat job (`parse_responses_request`). Each is timed over `--requests` in a row; the best of
`--rounds` is printed, in microseconds per request of process CPU time (the figure a busy
machine disturbs least).
"""

from __future__ import annotations

import argparse
import json
import resource
from collections.abc import Callable
from typing import Any


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def best_us(fn: Callable[[], Any], requests: int, rounds: int) -> float:
    """The best of `rounds` of `requests` calls of `fn`, in microseconds of CPU per call."""
    best = float("inf")
    for _ in range(rounds):
        start = cpu_s()
        for _ in range(requests):
            fn()
        best = min(best, (cpu_s() - start) / requests * 1e6)
    return best


def responses_body() -> bytes:
    items: list[dict[str, Any]] = []
    for k in range(3):
        items.append({"type": "message", "role": "user", "content": f"question {k}?"})
        items.append({"type": "message", "role": "assistant", "content": f"answer {k}."})
    items.append({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"})
    items.append({"type": "function_call_output", "call_id": "c", "output": "42"})
    tool = {"type": "object", "properties": {"x": {"type": "integer"}}}
    doc = {
        "model": "m",
        "instructions": "be brief",
        "input": items,
        "tools": [{"type": "function", "name": "f", "parameters": tool}],
        "max_output_tokens": 32,
    }
    return json.dumps(doc).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from neuron_trio.engine.engine import Engine
    from neuron_trio.engine.gguf.builtin import builtin_model_path
    from neuron_trio.engine.types import SamplingParams
    from neuron_trio.http.openai.responses_api import parse_responses_request

    engine = Engine.from_gguf(builtin_model_path(), max_batch=8, context=2048)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a short poem about the sea and the wind."},
    ]
    params = SamplingParams(max_tokens=16, temperature=0.0)

    def prepare_and_add() -> None:
        engine.cancel(engine.add(engine.prepare(params, messages=messages)))

    body = responses_body()
    results = {
        "prepare+add": best_us(prepare_and_add, args.requests, args.rounds),
        "responses parse": best_us(
            lambda: parse_responses_request(body), args.requests, args.rounds
        ),
    }
    for name, us in results.items():
        print(f"{name:16s} {us:8.1f} us/request (CPU, best of {args.rounds})")


if __name__ == "__main__":
    main()
