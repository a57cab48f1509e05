"""Start-up and first-request cost of the real daemon, and its memory before any request.

    python bench/bench_startup.py [--model FILE.gguf] [--starts 3] [--requests 10] [--dtype auto]
                                  [--max-batch 8] [--context 4096] [--fresh] [--set KEY=VALUE ...]
                                  [--node KEY=VALUE ...]

Each start: `neuron serve` with the built-in model (or `--model`'s GGUF file, under the same
name; devices = "cpu") on a free 127.0.0.1 port;
the time from exec to the first `/health` 200 ("ready", and the CPU time the daemon used until
then: a busy machine stretches the first, less the second); the daemon's RSS and the KV bytes
/v1/node reports, before any request; then `--requests` identical small chats in a row over
HTTP/2 (streamed, greedy, 16 tokens), the first sent the moment /health said 200. Printed:
ready time per start and the best, and the first request's time to first token, total and
the daemon's CPU time for it against the median of the others (goal: ratio ~1.0, nothing
lazily built on the first one; CPU time is the figure a busy machine disturbs least).
The starts share one state directory, as restarts of one node do (`--fresh`: a new state
directory every time): the first start packs the weights and fills the packed-weight cache
(a cold start), the later ones map it (warm; `--node weight_cache=false` turns it off).
`--set` adds a key to the model's config entry (`--set prefix_cache=false`), `--node` one to
`[node]`. The daemon's own account of where the time went (its "start-up phases" line) is
printed under each start. `--requests 0`: ready time and memory only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from daemon_harness import MODEL, cpu_seconds, get_json, rss_bytes, running_daemon

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "temperature": 0,
    "stream": True,
}


def timed_chat(client: httpx.Client) -> tuple[float, float]:
    """(time to the first content token, total) of one streamed chat, in seconds."""
    start = time.perf_counter()
    first: float | None = None
    with client.stream("POST", "/v1/chat/completions", json=CHAT) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices")
                if choices and choices[0]["delta"].get("content"):
                    first = time.perf_counter() - start
    total = time.perf_counter() - start
    return (total if first is None else first), total


def parse_value(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(raw)
    except ValueError:
        return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: built-in)")
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--node", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--fresh", action="store_true", help="a new state dir for every start")
    args = parser.parse_args()
    model: dict[str, Any] = {
        "dtype": args.dtype,
        "max_batch": args.max_batch,
        "context": args.context,
    }
    for item in args.set:
        key, _, value = item.partition("=")
        model[key] = parse_value(value)
    node = {}
    for item in args.node:
        key, _, value = item.partition("=")
        node[key] = parse_value(value)
    print(
        f"model {args.model or 'built-in'}; entry {model}; node {node}; {args.starts} starts, "
        f"{args.requests} requests each"
    )
    ready: list[float] = []
    with tempfile.TemporaryDirectory(prefix="neuron-bench-state-") as state:
        for n in range(args.starts):
            state_dir = Path(state) / (f"start-{n}" if args.fresh else "shared")
            ready.append(start_once(n, model, state_dir, args.requests, args.model, node))
    print(f"ready: best {min(ready):.2f}s, median {statistics.median(ready):.2f}s (goal <= 5 s)")
    if not args.fresh and len(ready) > 1:
        print(
            f"cold (start 1) {ready[0]:.2f}s; warm (2..) median {statistics.median(ready[1:]):.2f}s"
        )


def start_once(
    n: int,
    model: dict[str, Any],
    state_dir: Path,
    requests: int,
    model_file: Path | None = None,
    node: dict[str, Any] | None = None,
) -> float:
    """One start: ready time, memory, then `requests` chats; prints a line; the ready time."""
    with running_daemon(model, state_dir=state_dir, model_file=model_file, node=node) as daemon:
        rss = rss_bytes(daemon.pid)
        if requests < 1:
            print(
                f"start {n + 1}: ready {daemon.ready_s:.2f}s (CPU {daemon.ready_cpu_s:.2f}s); "
                f"RSS before any request {rss / 2**20:.0f} MiB"
            )
            print_phases(daemon.log_tail(60))
            return daemon.ready_s
        with httpx.Client(base_url=daemon.url, http1=False, http2=True, timeout=120) as client:
            client.get("/health")  # the connection is up before the first request
            times, cpu = [], []
            for _ in range(requests):
                before = cpu_seconds(daemon.pid)
                times.append(timed_chat(client))
                cpu.append(cpu_seconds(daemon.pid) - before)
        _, node = get_json(daemon.port, "/v1/node")
        log_lines = daemon.log_tail(60).splitlines()
    memory = (node["models"][0].get("memory") or {}) if node.get("models") else {}
    first_ttft, first_total = times[0]
    rest_ttft = statistics.median(t for t, _ in times[1:])
    rest_total = statistics.median(t for _, t in times[1:])
    print(
        f"start {n + 1}: ready {daemon.ready_s:.2f}s (CPU {daemon.ready_cpu_s:.2f}s); RSS before any request "
        f"{rss / 2**20:.0f} MiB, KV estimate {memory.get('kv_cache_bytes', 0) / 2**20:.0f} MiB; "
        f"request 1: TTFT {first_ttft * 1000:.0f} ms, total {first_total * 1000:.0f} ms; "
        f"requests 2..{requests} (median): TTFT {rest_ttft * 1000:.0f} ms, "
        f"total {rest_total * 1000:.0f} ms; first/rest TTFT {first_ttft / rest_ttft:.2f}x, "
        f"total {first_total / rest_total:.2f}x; daemon CPU request 1 {cpu[0] * 1000:.0f} ms, "
        f"2..{requests} (median) {statistics.median(cpu[1:]) * 1000:.0f} ms"
    )
    print_phases("\n".join(log_lines))
    return daemon.ready_s


def print_phases(log: str) -> None:
    """The daemon's log lines about its start-up (ready, warm-up, where the time went)."""
    for line in log.splitlines():
        if any(k in line for k in ("ready in", "start-up took", "warmed up", "start-up phases")):
            print("   ", line.split(" ", 2)[-1])


if __name__ == "__main__":
    main()
