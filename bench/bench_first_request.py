"""The first request against the next ones, with and without the warm-up, in one process.

    python bench/bench_first_request.py [--requests 10] [--dtype auto] [--tokens 16]

Two engines of the built-in model (devices = "cpu"), loaded the same way: one only probed
(one decode-shaped forward, as the model actor did before the warm-up existed), one probed and
warmed up (`engine.warm_up`). Then the same small chat (greedy) on each, alternately, so that
a busy machine disturbs both alike: request 1 against the median of requests 2..N, in wall
time and in process CPU time (the figure a busy machine disturbs least). The warm-up's own
time is printed too: it moves the cost from the first request to the start-up.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def chat(engine: Any, tokens: int) -> tuple[float, float]:
    from neuron_trio.engine.types import SamplingParams

    wall, cpu = time.perf_counter(), cpu_s()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.encode_prompt(engine.render_chat(messages), chat=True)
    engine.add(prompt, SamplingParams(max_tokens=tokens, temperature=0.0), chat=True)
    while engine.has_work:
        engine.step()
    return time.perf_counter() - wall, cpu_s() - cpu


def run(args: argparse.Namespace) -> None:
    from neuron_trio.engine.engine import Engine
    from neuron_trio.engine.gguf.builtin import builtin_model_path
    from neuron_trio.engine.warm_up import warm_up

    engines = {}
    for label in ("probe only", "warmed up"):
        engine = Engine.from_gguf(
            builtin_model_path(),
            dtype=args.dtype,
            device="cpu",
            max_batch=8,
            context=4096,
            prefix_cache=False,  # requests 2..N would otherwise reuse request 1's prompt
        )
        engine.probe()
        if label == "warmed up":
            wall, cpu = time.perf_counter(), cpu_s()
            report = warm_up(engine)
            print(
                f"warm-up: {time.perf_counter() - wall:.2f}s wall, {cpu_s() - cpu:.2f}s CPU ({report})"
            )
        engines[label] = engine
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in engines}
    for _ in range(args.requests):
        for label, engine in engines.items():
            times[label].append(chat(engine, args.tokens))
    for label, runs in times.items():
        first_wall, first_cpu = runs[0]
        rest_wall = statistics.median(w for w, _ in runs[1:])
        rest_cpu = statistics.median(c for _, c in runs[1:])
        print(
            f"{label}: request 1 {first_wall * 1000:.0f} ms wall, {first_cpu * 1000:.0f} ms CPU; "
            f"2..{args.requests} (median) {rest_wall * 1000:.0f} ms wall, {rest_cpu * 1000:.0f} ms "
            f"CPU; first/rest {first_wall / rest_wall:.2f}x wall, {first_cpu / rest_cpu:.2f}x CPU"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    # Torch work off the main thread, as in the daemon (docs/ARCHITECTURE.md: OpenMP pools).
    with ThreadPoolExecutor(1) as pool:
        pool.submit(run, args).result()


if __name__ == "__main__":
    main()
