"""End-to-end tokens/s over HTTP/2 streaming at 1 and 8 streams, as a ratio to the engine's own.

    python bench/bench_http.py [--dtype auto] [--device cpu] [--tokens 64] [--threads N]

Same run, same chat prompts, greedy decoding (so both sides produce the same tokens):
1. engine: `Engine.from_gguf(builtin model)` driven directly, `n` sequences submitted at
   once, stepped until all finish; completion tokens / wall time (prefill included);
2. HTTP: the real `Node` (model actor, watchdog, worker thread) behind `create_app` and
   `serve_http` on 127.0.0.1, and a client in a separate process (so its parsing does not
   share the server's interpreter) opening `n` concurrent streaming `/v1/chat/completions` on ONE
   cleartext HTTP/2 connection; completion tokens (from `usage`) / wall time.
Prints both rates and their ratio for n = 1 and n = 8 (target: at least 0.9).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from typing import Any

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some facts about the moon.",
    "Describe the water cycle.",
    "What makes a good cup of tea?",
    "Tell me about the history of Paris.",
    "How do bees make honey?",
    "Why is the sky blue?",
]
MODEL = "smollm2-135m"


# --- the client (runs in its own process) -------------------------------------------------


async def _client(url: str, streams: int, tokens: int) -> dict[str, Any]:
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


def client_main(url: str, streams: int, tokens: int) -> None:
    import trio

    print(json.dumps(trio.run(_client, url, streams, tokens)))


# --- the engine alone -----------------------------------------------------------------------


def engine_rate(engine: Any, streams: int, tokens: int) -> tuple[float, int]:
    from neuron_trio.engine.types import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    start = time.perf_counter()
    for k in range(streams):
        text = engine.render_chat([{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}])
        engine.add(engine.encode_prompt(text, chat=True), params, chat=True)
    generated = 0
    while engine.has_work:
        generated += sum(len(e.token_ids) for e in engine.step())
    return generated / (time.perf_counter() - start), generated


# --- the server -----------------------------------------------------------------------------


async def measure(args: argparse.Namespace, counts: tuple[int, ...]) -> None:
    """Engine and HTTP rates, interleaved per stream count, best of `args.rounds` each."""
    import torch
    import trio

    from neuron_trio.config import ModelConfig, NeuronConfig, NodeConfig, ServerConfig
    from neuron_trio.engine.builtin import builtin_model_path
    from neuron_trio.engine.engine import Engine
    from neuron_trio.http import create_app, serve_http
    from neuron_trio.service.node import Node

    device = torch.device("cpu" if args.device == "cpu" else "cuda:0")
    # Torch work stays off this (trio's) thread, as in the daemon: once a thread has run an
    # OpenMP region its thread pool lives as long as the thread, and libgomp then counts more
    # threads than CPUs and stops spinning in every other thread's pool (each parallel region
    # pays a futex wake-up: decode ran 2.5x slower on 2 cores, on both sides of the ratio).
    engine = await trio.to_thread.run_sync(
        partial(
            Engine.from_gguf,
            builtin_model_path(),
            dtype=args.dtype,
            device=device,
            max_batch=8,
            context=args.context,
        )
    )
    devices: Any = "cpu" if args.device == "cpu" else "auto"
    spec = ModelConfig(
        name=MODEL,
        source=f"builtin:{MODEL}",
        devices=devices,
        dtype=args.dtype,
        max_batch=8,
        context=args.context,
    )
    with tempfile.TemporaryDirectory() as state:
        config = NeuronConfig(
            server=ServerConfig(listen=["127.0.0.1:0"], drain_timeout_s=5.0),
            node=NodeConfig(state_dir=state, model_dirs=[state]),
            default_models=[spec],
        )
        node = Node(config)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            app = create_app(node, config)
            bound = await nursery.start(
                partial(serve_http, app, config, shutdown_trigger=stop.wait)
            )
            node.mark_serving()
            url = bound[0].url
            for n in counts:  # warm-up: every batch shape once on both sides
                await trio.to_thread.run_sync(engine_rate, engine, n, 4)
                await _run_client(url, n, 4)
            for n in counts:
                best_engine: tuple[float, int] = (0.0, 0)
                best_http: tuple[float, int] = (0.0, 0)
                for _ in range(args.rounds):
                    rate = await trio.to_thread.run_sync(engine_rate, engine, n, args.tokens)
                    best_engine = max(best_engine, rate)
                    report = await _run_client(url, n, args.tokens)
                    best_http = max(
                        best_http, (report["tokens"] / report["seconds"], report["tokens"])
                    )
                    ttft = report["ttft_s"]
                    print(
                        f"  {n} stream(s): engine {rate[0]:.1f} tok/s ({rate[1]} tokens); "
                        f"HTTP/2 {report['tokens'] / report['seconds']:.1f} tok/s ({report['tokens']} tokens), "
                        f"first tokens after {ttft[0] * 1000:.0f}..{ttft[-1] * 1000:.0f} ms"
                    )
                ratio = best_http[0] / best_engine[0]
                verdict = "meets" if ratio >= 0.9 else "misses"
                print(
                    f"{n} stream(s): engine {best_engine[0]:.1f} tok/s, HTTP/2 streaming {best_http[0]:.1f} tok/s, "
                    f"ratio {ratio:.2f} ({verdict} the 0.9 target)"
                )
            stop.set()
            nursery.cancel_scope.cancel()


async def _run_client(url: str, streams: int, tokens: int) -> dict[str, Any]:
    import trio

    command = [
        sys.executable,
        __file__,
        "--client",
        url,
        "--streams",
        str(streams),
        "--tokens",
        str(tokens),
    ]
    done = await trio.run_process(command, capture_stdout=True)
    report: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda (the node places the model itself)"
    )
    parser.add_argument("--tokens", type=int, default=64, help="max tokens per stream")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="measurements per stream count (best kept)"
    )
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args.client, args.streams, args.tokens)
        return

    import torch
    import trio

    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, "
        f"dtype {args.dtype}, {args.tokens} tokens per stream, best of {args.rounds}"
    )
    trio.run(measure, args, (1, 8))


if __name__ == "__main__":
    main()
