"""Memory after load and start to ready, neuron against llama.cpp, every model of the table in
one run (issue 49: RSS <= llama.cpp's, start less `import torch` <= 1.5 s).

    python bench/bench_footprint.py [--models smollm2,gemma3,qwen2.5-0.5b] [--starts 2]
                                    [--threads 2] [--llamacpp-venv ~/.cache/llamacpp-peer]
                                    [--env NEURON_DENSE_COPIES=0 ...]

For each model: neuron's real daemon (`neuron serve`, dtype auto, 8 sequences of 4,096 tokens,
as bench_table.py's fresh starts) started once to fill its packed-weight cache (cold), then
`--starts` times on that state dir (a restart: warm); llama.cpp (`Llama(...)` in the peer venv,
n_ctx 8 x 4,096) started `--starts` times. Each start: the time from spawn to ready (neuron:
the first /health 200; llama.cpp: `Llama(...)` returned) and the RSS then, with its anonymous
and file-backed parts (/proc/PID/status). `import torch` alone (a fresh interpreter, the best
of 3) is timed in the same run and taken off neuron's ready time, as the issue counts it.
Figures are the best of the starts (a shared machine only ever slows a start). Prints the
Markdown table and each warm start's "start-up phases" line.

Right after each warm start is ready, a first request, then a first JSON one (`json_object`),
each of 8 greedy tokens, are timed (a chat, or a completion where the file has no chat
template): what start-up left for the first requests to build (llguidance's tokenizer is
built by the first constrained request, not before ready).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import llamacpp_peer  # noqa: E402
from bench.daemon_harness import MODEL, cpu_seconds, running_daemon  # noqa: E402
from bench.table_models import MODELS, BenchModel  # noqa: E402

SEQS = 8
CONTEXT = 4096


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of a process, in MiB."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            got[key] = int(value.split()[0]) / 1024
    return got


def import_torch_s() -> tuple[float, float]:
    """The best of 3 fresh interpreters' `import torch` (the part of start-up not counted):
    (wall, CPU) seconds."""
    wall = cpu = float("inf")
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        wall = min(wall, time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        cpu = min(cpu, used)
    return wall, cpu


def wait_for_cache(state: Path, timeout_s: float = 900) -> None:
    """Until the packed weights' cache entry (`*.nwc`, not a tokenizer's `merges-*`) lies in
    `state`: the cold start writes it in the background, and a stop before it is done (SIGKILL
    30 s after SIGTERM, which a busy machine reaches) would leave the restarts a miss."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(not p.name.startswith("merges-") for p in state.glob("cache/weights/*.nwc")):
            return
        time.sleep(1)


_PLAIN = {"max_tokens": 8, "temperature": 0}
_JSON = {**_PLAIN, "response_format": {"type": "json_object"}}


def post_s(port: int, path: str, body: dict[str, Any]) -> float:
    """Seconds to a complete answer of one request (RuntimeError unless 200)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        started = time.perf_counter()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read()
        if response.status != 200:
            raise RuntimeError(f"{path}: {response.status} {text[:300]!r}")
        return time.perf_counter() - started
    finally:
        conn.close()


def first_requests(port: int, model: str) -> tuple[float, float]:
    """The first plain request's and the first JSON request's seconds, right after ready: a
    chat, or a completion where the model has no chat template (then no JSON request, NaN:
    completions take no `response_format`)."""
    chat: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours."}],
    }
    completion: dict[str, Any] = {"model": model, "prompt": "Three colours are"}
    try:
        plain = post_s(port, "/v1/chat/completions", {**chat, **_PLAIN})
    except RuntimeError as exc:
        if "no chat template" not in str(exc):
            raise
        return post_s(port, "/v1/completions", {**completion, **_PLAIN}), float("nan")
    return plain, post_s(port, "/v1/chat/completions", {**chat, **_JSON})


def neuron_start(
    model: BenchModel, path: Path, state: Path, args: argparse.Namespace, cold: bool = False
) -> dict[str, Any]:
    entry: dict[str, Any] = {"dtype": "auto", "max_batch": SEQS, "context": CONTEXT}
    env = {"OMP_NUM_THREADS": str(args.threads), **dict(e.split("=", 1) for e in args.env)}
    with running_daemon(
        entry,
        env=env,
        timeout_s=900,
        state_dir=state,
        model_file=None if model.builtin else path,
    ) as daemon:
        if cold:
            wait_for_cache(state)
        got: dict[str, Any] = {"ready_s": daemon.ready_s, "cpu_s": daemon.ready_cpu_s}
        got.update(memory_mib(daemon.pid))
        got["phases"] = [
            line.split(" ", 2)[-1]
            for line in daemon.log_tail(80).splitlines()
            if "start-up phases" in line
        ]
        if not cold:
            got["first_s"], got["first_json_s"] = first_requests(daemon.port, MODEL)
        return got


def llamacpp_start(path: Path, logs: Path, venv: Path, threads: int) -> dict[str, Any]:
    worker = llamacpp_peer.spawn(
        venv, "cold", path, logs / "llamacpp.log", threads=threads, context=CONTEXT, seqs=SEQS
    )
    try:
        ready_s, _ = worker.wait_ready(600)
        return {"ready_s": ready_s, "cpu_s": cpu_seconds(worker.pid), **memory_mib(worker.pid)}
    finally:
        worker.close()


def best(runs: list[dict[str, Any]], key: str) -> float:
    return min(r[key] for r in runs) if runs else float("nan")


def measure(model: BenchModel, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    path = model.resolve()
    state = logs / f"{model.key}-state"
    cold = neuron_start(model, path, state, args, cold=True)
    print(f"{model.key}: neuron cold ready {cold['ready_s']:.2f}s RSS {cold['VmRSS']:.0f}")
    neuron, peer = [], []
    for n in range(args.starts):
        neuron.append(neuron_start(model, path, state, args))
        got = neuron[-1]
        print(
            f"  neuron warm {n + 1}: ready {got['ready_s']:.2f}s (CPU {got['cpu_s']:.2f}s), RSS {got['VmRSS']:.0f} MiB "
            f"(anon {got['RssAnon']:.0f}, file {got['RssFile']:.0f}); first request "
            f"{got['first_s']:.2f}s, first JSON request {_seconds(got['first_json_s'])}"
        )
        for line in got["phases"]:
            print("    ", line)
        if llamacpp_peer.peer_python(args.llamacpp_venv) is not None:
            peer.append(llamacpp_start(path, logs, args.llamacpp_venv, args.threads))
            got = peer[-1]
            print(
                f"  llama.cpp {n + 1}: ready {got['ready_s']:.2f}s (CPU {got['cpu_s']:.2f}s), RSS {got['VmRSS']:.0f} MiB "
                f"(anon {got['RssAnon']:.0f}, file {got['RssFile']:.0f})"
            )
    return {"label": model.label, "cold": cold, "neuron": neuron, "llamacpp": peer}


def _seconds(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f} s"


def table(results: list[dict[str, Any]], torch_s: tuple[float, float]) -> str:
    """The Markdown table: RSS, then start to ready (wall and CPU, neuron's less `import
    torch`'s), best of the starts."""
    rows = [
        "| model | RSS neuron | RSS llama.cpp | ready neuron, less `import torch` (wall / CPU) "
        "| ready llama.cpp (wall / CPU) | neuron's first request, first JSON request |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        neuron, peer = r["neuron"], r["llamacpp"]
        rows.append(
            f"| {r['label']} | {best(neuron, 'VmRSS'):,.0f} MiB | {best(peer, 'VmRSS'):,.0f} MiB "
            f"| {best(neuron, 'ready_s') - torch_s[0]:.2f} / "
            f"{best(neuron, 'cpu_s') - torch_s[1]:.2f} s "
            f"| {best(peer, 'ready_s'):.2f} / {best(peer, 'cpu_s'):.2f} s "
            f"| {best(neuron, 'first_s'):.2f} s, {_seconds(best(neuron, 'first_json_s'))} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--starts", type=int, default=2, help="warm starts per side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="for neuron's daemon"
    )
    parser.add_argument("--llamacpp-venv", type=Path, default=llamacpp_peer.default_venv())
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]  # others' work on a shared machine slows every start
    torch_s = import_torch_s()
    print(f"import torch: {torch_s[0]:.2f} s, CPU {torch_s[1]:.2f} s (best of 3)")
    with tempfile.TemporaryDirectory(prefix="bench-footprint-") as tmp:
        results = [measure(MODELS[k], args, Path(tmp)) for k in args.models.split(",")]
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, {args.threads} threads, {SEQS} x {CONTEXT} KV cells; best of "
        f"{args.starts} starts a side (neuron: restarts on its packed-weight cache); "
        f"import torch {torch_s[0]:.2f} s wall, {torch_s[1]:.2f} s CPU; neuron's env {args.env}; "
        f"load average {load_at_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n"
    )
    print(table(results, torch_s))


if __name__ == "__main__":
    main()
