"""Soak: N concurrent streaming chat completions over ONE HTTP/2 connection for M minutes.

    python bench/soak.py [--streams 64] [--minutes 10] [--tokens 32] [--max-requests 100000]

Starts a real `neuron serve` (the built-in model on the CPU, 127.0.0.1, a free port, a
temporary state directory), waits for /health, then keeps `--streams` streaming
`/v1/chat/completions` in flight on one cleartext HTTP/2 connection (as a router does) until
the time or the request budget is spent, polling /health once a second on a second
connection. Prints errors (each kind with a count; the target is 0), requests completed, the
daemon's RSS at start and end, time to first token p50/p99, /health failures, and the
daemon's exit code after SIGTERM (0: drained cleanly). Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on the path, the repository is not
    sys.path.insert(0, str(REPO))

from tests.neuron_process import free_port, spawn_neuron, stop_neuron, wait_ready  # noqa: E402

MODEL = "smollm2-135m"
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Why is the sky blue?",
    "How do bees make honey?",
]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def soak(url: str, args: argparse.Namespace, pid: int) -> dict[str, Any]:
    import httpx
    import trio

    errors: collections.Counter[str] = collections.Counter()
    ttft: list[float] = []
    done = 0
    started = 0
    health_fail = 0
    deadline = trio.current_time() + args.minutes * 60

    async def one_stream(client: httpx.AsyncClient, k: int) -> None:
        nonlocal done, started
        while trio.current_time() < deadline and started < args.max_requests:
            started += 1
            doc = {
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
                "max_tokens": args.tokens,
                "stream": True,
            }
            t0 = time.perf_counter()
            first = True
            finished = False
            try:
                with trio.fail_after(args.request_timeout):
                    async with client.stream("POST", "/v1/chat/completions", json=doc) as r:
                        if r.status_code != 200:
                            errors[f"status {r.status_code}: {(await r.aread())[:120]!r}"] += 1
                            continue
                        async for line in r.aiter_lines():
                            if line == "data: [DONE]":
                                finished = True
                            elif line.startswith("data: ") and first:
                                chunk = json.loads(line[6:])
                                if chunk.get("choices") and chunk["choices"][0]["delta"].get(
                                    "content"
                                ):
                                    ttft.append(time.perf_counter() - t0)
                                    first = False
            except Exception as exc:  # every failure is counted, by kind
                errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
                continue
            if finished:
                done += 1
            else:
                errors["stream ended without [DONE]"] += 1

    async def health(client: httpx.AsyncClient) -> None:
        nonlocal health_fail
        while trio.current_time() < deadline and started < args.max_requests:
            try:
                with trio.fail_after(5):
                    r = await client.get("/health")
                if r.status_code != 200:
                    health_fail += 1
            except Exception:
                health_fail += 1
            await trio.sleep(1)

    limits = httpx.Limits(max_connections=1)
    timeout = httpx.Timeout(args.request_timeout)
    rss_start = rss_bytes(pid)
    async with (
        httpx.AsyncClient(
            base_url=url, http1=False, http2=True, limits=limits, timeout=timeout
        ) as client,
        httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=10) as probe,
    ):
        await client.get("/health")
        t_start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(health, probe)
            for k in range(args.streams):
                nursery.start_soon(one_stream, client, k)
        wall = time.perf_counter() - t_start
    return {
        "errors": dict(errors),
        "requests_started": started,
        "requests_completed": done,
        "wall_s": round(wall, 1),
        "rss_start_mb": round(rss_start / 1e6, 1),
        "rss_end_mb": round(rss_bytes(pid) / 1e6, 1),
        "ttft_p50_s": round(percentile(ttft, 0.50), 3),
        "ttft_p99_s": round(percentile(ttft, 0.99), 3),
        "health_failures": health_fail,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--max-batch", type=int, default=16)
    args = parser.parse_args()

    import trio

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="neuron-soak-") as tmp:
        config = Path(tmp) / "neuron.toml"
        config.write_text(
            f'[server]\nlisten = ["127.0.0.1:{port}"]\nmax_queue = {args.streams}\n'
            f'drain_timeout_s = 30\n[node]\nstate_dir = "{tmp}/state"\n'
            f'[[default_models]]\nname = "{MODEL}"\nsource = "builtin:{MODEL}"\n'
            f'devices = "cpu"\nmax_batch = {args.max_batch}\ncontext = 1024\n'
        )
        log_path = Path(tmp) / "daemon.log"
        # the log level of this environment (default WARNING): child_env drops NEURON_*
        env = {"NEURON_LOG_LEVEL": os.environ.get("NEURON_LOG_LEVEL", "WARNING")}
        proc = spawn_neuron(config, log_path, env)
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_ready(proc, port, log_path, 180)
            except RuntimeError as exc:
                raise SystemExit(str(exc)) from None
            result = trio.run(soak, url, args, proc.pid)
        finally:
            result_exit = stop_neuron(proc, timeout=60)
        log = log_path.read_text(errors="replace")
        tracebacks = sum(1 for line in log.splitlines() if "Traceback" in line)
    result |= {
        "streams": args.streams,
        "minutes": args.minutes,
        "daemon_exit": result_exit,
        "daemon_tracebacks": tracebacks,
    }
    print(json.dumps(result, indent=2))
    ok = not result["errors"] and result_exit == 0 and not tracebacks
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
