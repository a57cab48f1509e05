"""Tokens/s through the real daemon over HTTP/2 at 1/4/8/16 concurrent streams, as a ratio to
one stream (and, with `--engine`, to the engine alone in this process).

    python bench/bench_http.py [--streams 1,4,8,16] [--tokens 64] [--rounds 3] [--dtype auto]
                               [--max-batch 8] [--context 4096] [--engine]

The daemon is a real `neuron serve` (built-in model, devices = "cpu") started for the run
(daemon_harness.py); the client is this process: `n` concurrent streaming
`/v1/chat/completions` (greedy, `max_tokens` each, different prompts) on ONE cleartext HTTP/2
connection, as a router sends them; rate = completion tokens (from `usage`) / wall time, first
request sent to last token, prefill included. Every stream count is run once first as a
warm-up, then `--rounds` rounds of every count (best kept). Printed: each rate, and its ratio
to one stream (the goal: 8 streams at 4x one or better). With more streams than `max_batch`,
the rest wait in the daemon's queue.

`--engine` also drives `Engine.from_gguf(builtin model)` directly in this process (the daemon
idle meanwhile), same prompts and tokens: the HTTP/engine ratio shows what the service and
HTTP layers cost (earlier target: 0.9).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from daemon_harness import MODEL, running_daemon
from prompts import PROMPTS


async def http_rate(url: str, streams: int, tokens: int) -> dict[str, Any]:
    """`streams` concurrent streamed chats on one HTTP/2 connection: tokens, seconds, TTFTs."""
    import httpx
    import trio

    limits = httpx.Limits(max_connections=1)
    async with httpx.AsyncClient(
        base_url=url, http1=False, http2=True, limits=limits, timeout=600
    ) as client:
        await client.get("/health")  # the connection is up before the clock starts
        completion_tokens = 0
        first_token_s: list[float] = []
        start = time.perf_counter()

        async def one(k: int) -> None:
            nonlocal completion_tokens
            doc = {
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
                "max_tokens": tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with client.stream("POST", "/v1/chat/completions", json=doc) as r:
                r.raise_for_status()
                first = True
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    choices = chunk.get("choices")
                    if first and choices and choices[0]["delta"].get("content"):
                        first_token_s.append(time.perf_counter() - start)
                        first = False
                    if chunk.get("usage"):
                        completion_tokens += chunk["usage"]["completion_tokens"]

        async with trio.open_nursery() as nursery:
            for k in range(streams):
                nursery.start_soon(one, k)
        seconds = time.perf_counter() - start
    return {"tokens": completion_tokens, "seconds": seconds, "ttft_s": sorted(first_token_s)}


def engine_rate(engine: Any, streams: int, tokens: int) -> float:
    """The engine alone: `streams` sequences submitted at once, stepped until all finish."""
    from neuron_trio.engine.types import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    start = time.perf_counter()
    for k in range(streams):
        text = engine.render_chat([{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}])
        engine.add(engine.encode_prompt(text, chat=True), params, chat=True)
    generated = 0
    while engine.has_work:
        generated += sum(len(e.token_ids) for e in engine.step())
    return generated / (time.perf_counter() - start)


async def measure(args: argparse.Namespace, counts: list[int]) -> None:
    import trio

    engine = None
    if args.engine:
        from functools import partial

        from neuron_trio.engine.engine import Engine
        from neuron_trio.engine.gguf.builtin import builtin_model_path

        # Torch work off trio's thread, as in the daemon (an OpenMP pool on the main thread
        # slowed decode 2.5x on 2 cores: docs/ARCHITECTURE.md).
        engine = await trio.to_thread.run_sync(
            partial(
                Engine.from_gguf,
                builtin_model_path(),
                dtype=args.dtype,
                device="cpu",
                max_batch=args.max_batch,
                context=args.context,
            )
        )
    model = {"dtype": args.dtype, "max_batch": args.max_batch, "context": args.context}
    with running_daemon(model) as daemon:
        print(f"daemon ready in {daemon.ready_s:.1f}s at {daemon.url}")
        for n in counts:  # warm-up: every batch shape once
            await http_rate(daemon.url, n, 4)
            if engine is not None and n <= args.max_batch:
                await trio.to_thread.run_sync(engine_rate, engine, n, 4)
        # Rounds outside, stream counts inside: a machine whose load drifts disturbs every
        # count alike, not the last ones more.
        rates: dict[int, float] = dict.fromkeys(counts, 0.0)
        engine_rates: dict[int, float] = dict.fromkeys(counts, 0.0)
        for r in range(args.rounds):
            for n in counts:
                report = await http_rate(daemon.url, n, args.tokens)
                rate = report["tokens"] / report["seconds"]
                rates[n] = max(rates[n], rate)
                ttft = report["ttft_s"]
                line = (
                    f"  round {r + 1}, {n:2d} stream(s): HTTP/2 {rate:.1f} tok/s "
                    f"({report['tokens']} tokens), first tokens after "
                    f"{ttft[0] * 1000:.0f}..{ttft[-1] * 1000:.0f} ms"
                )
                if engine is not None and n <= args.max_batch:
                    e = await trio.to_thread.run_sync(engine_rate, engine, n, args.tokens)
                    engine_rates[n] = max(engine_rates[n], e)
                    line += f"; engine alone {e:.1f} tok/s"
                print(line)
        base = rates[counts[0]]
        for n in counts:
            summary = (
                f"{n:2d} stream(s): {rates[n]:.1f} tok/s, {rates[n] / base:.2f}x "
                f"{counts[0]} stream(s)"
            )
            if engine_rates[n]:
                summary += f"; HTTP/engine {rates[n] / engine_rates[n]:.2f}"
            print(summary)
    if 1 in rates and 8 in rates:
        ratio = rates[8] / rates[1]
        print(
            f"8 streams / 1 stream: {ratio:.2f}x ({'meets' if ratio >= 4 else 'misses'} the 4x goal)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--streams", default="1,4,8,16", help="comma-separated stream counts")
    parser.add_argument("--tokens", type=int, default=64, help="max tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per count (best kept)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--engine", action="store_true", help="also the engine alone, in-process")
    args = parser.parse_args()
    counts = [int(c) for c in args.streams.split(",")]

    import trio

    print(
        f"dtype {args.dtype}, max_batch {args.max_batch}, context {args.context}, "
        f"{args.tokens} tokens per stream, best of {args.rounds}"
    )
    trio.run(measure, args, counts)


if __name__ == "__main__":
    main()
