"""neuron against llama.cpp on the same GGUF files, threads and token ids, in one run: the
table the README publishes ("Benchmarks against llama.cpp").

    python bench/bench_table.py [--models smollm2,gemma3,qwen2.5-0.5b] [--quick]
                                [--rounds 5] [--cold-rounds 3] [--threads 2]
                                [--llamacpp-venv ~/.cache/llamacpp-peer] [--json PATH]
                                [--note TEXT] [--write-readme] [--speculation-only]

For each model, two measuring processes run side by side: neuron's engine
(bench/table_neuron.py: `Engine.from_gguf`, dtype auto, as serving steps it) and llama.cpp
(bench/llamacpp_peer.py, llama-cpp-python from the peer venv). Each round runs every measure on
one, then the other (the order flips every round), so load that comes and goes on a shared
machine falls on both; a figure is the median of the rounds:

- decode, batch 1: (n - 1) / (T(n) - T(1)), greedy, as bench_decode.py measures it;
- decode, 8 streams: 8 prompts prefilled together, then the steps that decode all 8 timed
  (neuron: 8 sequences in the engine; llama.cpp: one llama_batch of 8 sequence ids a step);
- prefill on a 512- and a 2,048-token prompt: the prompt's time to its first token
  (neuron: chunked as serving does; llama.cpp: n_batch = n_ubatch = 512);
- then fresh processes (`--cold-rounds`): time from process start to ready (neuron: the real
  daemon, spawn to the first /health 200; llama.cpp: interpreter start until `Llama(...)` has
  returned), RSS right then (/proc), and the first request's time to first token of a short
  prompt (neuron: /v1/completions over HTTP, max_tokens 1; llama.cpp: `eval` in-process).
  neuron's fresh starts share one state dir, as a node's restarts do: the first packs the
  weights and caches them ([node] weight_cache), the later ones map the cache, so the median
  of 3 is a restart's.

Both sides hold the same KV capacity: 8 sequences of 2,304 tokens in the measuring
processes, 8 of 4,096 in the fresh ones (neuron's max_batch × context; llama.cpp's n_ctx).
The roofline: a streaming read's bandwidth (bench/roofline.py) over each engine's bytes read
per decoded token. The read is timed before the first model and after each one, and the
fastest is kept: on a shared machine one sample can catch a slow minute (once 32 GB/s where
the minutes around it read 50-59), and a limit below what the engines then reach means
nothing. Prints the Markdown, writes the raw runs as JSON (bench/results/, not committed);
`--write-readme` puts the Markdown between README.md's bench-table markers.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import llamacpp_peer, table_format, table_lookup  # noqa: E402
from bench.daemon_harness import rss_bytes, running_daemon  # noqa: E402
from bench.prompts import PROMPTS, TASKS  # noqa: E402
from bench.roofline import gguf_decode_bytes, stream_bandwidth  # noqa: E402
from bench.table_models import MODELS, BenchModel  # noqa: E402
from bench.table_worker import Worker, WorkerError  # noqa: E402

MEASURE_CONTEXT = 2304  # tokens per sequence in the measuring processes: 2,048 + room
SERVE_CONTEXT = 4096  # … in the fresh processes (the daemon's default)
SEQS = 8
DECODE_TEXT = "Once upon a time, in a small village by the sea,"
TTFT_TEXT = "What is the capital of France?"
PREFILL_LENGTHS = {"prefill_512": 512, "prefill_2048": 2048}
CALL_TIMEOUT_S = 900  # one measure on one side (a 2,048-token prefill on a busy machine)
SIDES = ("neuron", "llamacpp")


class Settings:
    def __init__(self, args: argparse.Namespace) -> None:
        self.quick = args.quick
        self.rounds = args.rounds or (1 if args.quick else 5)
        self.cold_rounds = args.cold_rounds or (1 if args.quick else 3)
        self.decode_tokens = 16 if args.quick else 64
        self.stream_tokens = 8 if args.quick else 32
        self.threads = args.threads
        self.venv = args.llamacpp_venv
        self.logs = Path(tempfile.mkdtemp(prefix="bench-table-"))
        self.spec_rounds = args.spec_rounds or (1 if args.quick else 3)
        self.spec_tokens = 48 if args.quick else args.spec_tokens
        self.lookup_tokens = args.lookup_tokens
        self.speculation_only = args.speculation_only


# ---- one measure on one side ---------------------------------------------------------------


def decode_rate(answer: dict[str, Any], n: int) -> float:
    """(n - 1) / (T(n) - T(1)) from a `decode` answer (the best of each if several)."""
    return (n - 1) / max(min(answer["t_n"]) - min(answer["t_1"]), 1e-9)


def run_measure(worker: Worker, key: str, prompts: dict[str, Any], s: Settings) -> float:
    if key == "decode_1":
        answer = worker.call("decode", CALL_TIMEOUT_S, prompt=prompts["decode"], n=s.decode_tokens)
        return decode_rate(answer, s.decode_tokens)
    if key == "decode_8":
        answer = worker.call(
            "streams", CALL_TIMEOUT_S, prompts=prompts["streams"], n=s.stream_tokens
        )
    else:
        answer = worker.call("prefill", CALL_TIMEOUT_S, prompt=prompts[key])
    return float(answer["tokens"] / answer["seconds"])


# ---- the measuring processes ---------------------------------------------------------------


def neuron_worker(path: Path, s: Settings, log: Path) -> Worker:
    argv = [sys.executable, str(REPO / "bench" / "table_neuron.py"), str(path)]
    argv += ["--threads", str(s.threads), "--context", str(MEASURE_CONTEXT), "--seqs", str(SEQS)]
    env = {**os.environ, "OMP_NUM_THREADS": str(s.threads), "PYTHONPATH": str(REPO)}
    return Worker(argv, log, env)


def measure_model(model: BenchModel, path: Path, s: Settings, out: dict[str, Any]) -> None:
    """The interleaved rounds of the four throughput measures; fills `out`."""
    runs = out["runs"]
    neuron = neuron_worker(path, s, s.logs / f"{model.key}-neuron.log")
    peer: Worker | None = None
    try:
        neuron.wait_ready(600)
        prompts: dict[str, Any] = {
            "decode": neuron.call("encode", texts=[DECODE_TEXT])["ids"][0],
            "streams": neuron.call("encode", texts=list(PROMPTS[:SEQS]))["ids"],
        }
        for key, length in PREFILL_LENGTHS.items():
            prompts[key] = neuron.call("filler", tokens=length)["ids"]
        out["neuron_info"] = neuron.call("info")
        out["bytes_per_token"]["neuron"] = out["neuron_info"]["decode_bytes"]
        try:
            peer = llamacpp_peer.spawn(
                s.venv,
                "measure",
                path,
                s.logs / f"{model.key}-llamacpp.log",
                threads=s.threads,
                context=MEASURE_CONTEXT,
                seqs=SEQS,
            )
            peer.wait_ready(600)
            out["llamacpp_info"] = peer.call("info")
        except (FileNotFoundError, WorkerError) as exc:
            out["errors"].append(f"llama.cpp: {exc}")
            if peer is not None:
                peer.close()
            peer = None
        workers = {"neuron": neuron, "llamacpp": peer}
        for worker in workers.values():  # warm-up: the first prefill pays for allocations
            if worker is not None:
                worker.call("prefill", CALL_TIMEOUT_S, prompt=prompts["prefill_512"])
        for r in range(s.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for key in ("decode_1", "decode_8", *PREFILL_LENGTHS):
                for side in order:
                    worker = workers[side]
                    if worker is None:
                        continue
                    try:
                        value = run_measure(worker, key, prompts, s)
                    except WorkerError as exc:
                        out["errors"].append(f"{side} {key}: {exc}")
                        continue
                    runs[key][side].append(value)
                    print(f"  round {r + 1} {key:>13} {side:>8}: {value:9.1f} tok/s", flush=True)
        out["prompt_tokens"] = {k: len(v) for k, v in prompts.items() if k != "streams"}
        out["prompt_tokens"]["streams"] = [len(p) for p in prompts["streams"]]
        out["ttft_prompt"] = neuron.call("encode", texts=[TTFT_TEXT])["ids"][0]
        measure_speculation(model, path, s, out, neuron)
    finally:
        neuron.close()
        if peer is not None:
            peer.close()


# ---- speculation: batch-1 decode on the tasks, with and without prompt lookup -------------


def speculate(worker: Worker, prompt: list[int], s: Settings, lookup: int) -> dict[str, Any]:
    """One greedy answer's tokens and decode rate (tok/s after its first token)."""
    answer = worker.call(
        "speculate", CALL_TIMEOUT_S, prompt=prompt, max_tokens=s.spec_tokens, lookup=lookup
    )
    answer["rate"] = answer["count"] / max(answer["seconds"], 1e-9)
    return answer


def measure_speculation(
    model: BenchModel, path: Path, s: Settings, out: dict[str, Any], neuron: Worker
) -> None:
    """Each task's chat prompt (neuron's template and ids, given to both), answered by each
    engine with and without its prompt lookup, the four arms alternated (reversed every
    round); fills out["spec"] (rates) and out["spec_answers"] (the last answer's tokens)."""
    prompts = dict(zip(TASKS, neuron.call("chat", texts=list(TASKS.values()))["ids"], strict=True))
    out["spec_prompt_tokens"] = {task: len(p) for task, p in prompts.items()}
    spec = out["spec"] = {t: {a: [] for a in table_format.SPEC_ARMS} for t in TASKS}
    answers: dict[str, dict[str, list[int]]] = {t: {} for t in TASKS}
    out["spec_answers"] = answers
    peer: Worker | None = None
    try:
        log = s.logs / f"{model.key}-lookup.log"
        peer = table_lookup.spawn(s.venv, path, log, threads=s.threads, context=MEASURE_CONTEXT)
        peer.wait_ready(600)
    except (FileNotFoundError, WorkerError) as exc:
        out["errors"].append(f"llama.cpp lookup: {exc}")
        if peer is not None:
            peer.close()
        peer = None
    arms = [
        (arm, neuron if arm.startswith("neuron") else peer, s.lookup_tokens if lookup else 0)
        for arm, lookup in zip(table_format.SPEC_ARMS, (0, 1, 0, 1), strict=True)
    ]
    try:
        for r in range(s.spec_rounds):
            for task, prompt in prompts.items():
                for arm, worker, lookup in arms if r % 2 == 0 else arms[::-1]:
                    if worker is None:
                        continue
                    try:
                        got = speculate(worker, prompt, s, lookup)
                    except WorkerError as exc:
                        out["errors"].append(f"{arm} {task}: {exc}")
                        continue
                    spec[task][arm].append(got["rate"])
                    answers[task][arm] = got["tokens"]
                    print(
                        f"  round {r + 1} {task:>9} {arm:>15}: {got['rate']:7.1f} tok/s "
                        f"({got['count'] + 1} tokens)",
                        flush=True,
                    )
    finally:
        if peer is not None:
            peer.close()


def speculation_only(model: BenchModel, path: Path, s: Settings, out: dict[str, Any]) -> None:
    """`--speculation-only`: the speculation rows alone (a busy machine's short run)."""
    neuron = neuron_worker(path, s, s.logs / f"{model.key}-neuron.log")
    try:
        neuron.wait_ready(600)
        out["bytes_per_token"]["neuron"] = neuron.call("info")["decode_bytes"]
        measure_speculation(model, path, s, out, neuron)
    finally:
        neuron.close()


# ---- fresh processes -----------------------------------------------------------------------


def first_completion_s(port: int, model: str) -> float:
    """Seconds to a non-streamed /v1/completions answer of one token (its first token)."""
    body = json.dumps(
        {"model": model, "prompt": TTFT_TEXT, "max_tokens": 1, "temperature": 0}
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read()
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"/v1/completions answered {response.status}: {text[:300]!r}")
    return elapsed


def neuron_state(s: Settings, model: BenchModel) -> Path:
    """The state dir that a model's fresh neuron starts share (under the run's logs)."""
    return s.logs / f"{model.key}-state"


def cold_neuron(model: BenchModel, path: Path, s: Settings) -> dict[str, float]:
    entry: dict[str, Any] = {
        "name": "bench",
        "devices": "cpu",
        "dtype": "auto",
        "max_batch": SEQS,
        "context": SERVE_CONTEXT,
    }
    if not model.builtin:
        entry["source"] = str(path)
    env = {"OMP_NUM_THREADS": str(s.threads)}
    # one state dir for the model's fresh starts, as a node keeps it between restarts: the
    # first start packs the weights and caches them ([node] weight_cache), later ones map them
    state = neuron_state(s, model)
    state.mkdir(parents=True, exist_ok=True)
    with running_daemon(
        entry, env=env, model_dirs=[path.parent], timeout_s=600, state_dir=state
    ) as daemon:
        rss = rss_bytes(daemon.pid)
        ttft = first_completion_s(daemon.port, "bench")
        return {"ready_s": daemon.ready_s, "rss_mib": rss / 2**20, "ttft_cold_ms": ttft * 1e3}


def cold_llamacpp(
    model: BenchModel, path: Path, s: Settings, prompt: list[int]
) -> dict[str, float]:
    worker = llamacpp_peer.spawn(
        s.venv,
        "cold",
        path,
        s.logs / f"{model.key}-llamacpp-cold.log",
        threads=s.threads,
        context=SERVE_CONTEXT,
        seqs=SEQS,
    )
    try:
        ready_s, _ = worker.wait_ready(600)
        rss = rss_bytes(worker.pid)
        ttft = worker.call("ttft", CALL_TIMEOUT_S, prompt=prompt)["seconds"]
    finally:
        worker.close()
    return {"ready_s": ready_s, "rss_mib": rss / 2**20, "ttft_cold_ms": ttft * 1e3}


def cold_starts(model: BenchModel, path: Path, s: Settings, out: dict[str, Any]) -> None:
    runs = out["runs"]
    has_peer = llamacpp_peer.peer_python(s.venv) is not None
    for r in range(s.cold_rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            try:
                if side == "neuron":
                    got = cold_neuron(model, path, s)
                elif has_peer and "ttft_prompt" in out:
                    got = cold_llamacpp(model, path, s, out["ttft_prompt"])
                else:
                    continue
            except (RuntimeError, OSError) as exc:
                out["errors"].append(f"{side} cold start: {exc}")
                continue
            for key, value in got.items():
                runs[key][side].append(value)
            shown = ", ".join(f"{k} {v:.2f}" for k, v in got.items())
            print(f"  cold {r + 1} {side:>8}: {shown}", flush=True)
    # the packed weights' cache (0.1-0.6 GB a model) would otherwise stay in the temp dir after
    # every run; the logs and the starts' records stay
    shutil.rmtree(neuron_state(s, model) / "cache", ignore_errors=True)


# ---- the run -------------------------------------------------------------------------------


def git_commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" (with uncommitted changes)" if git("status", "--porcelain") else "")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def llama_build(info: dict[str, Any] | None) -> str:
    """llama-cpp-python's version and the CPU features its build enabled (from
    llama_print_system_info: those set to 1)."""
    if not info:
        return "llama-cpp-python: not run"
    pairs = [p.strip() for p in info["system_info"].replace("CPU :", "").split("|")]
    on = [p.split("=")[0].strip() for p in pairs if p.endswith("= 1")]
    amx = "AMX on" if any("AMX" in f for f in on) else "AMX off"
    return f"llama-cpp-python {info['version']} (CPU backend: {', '.join(on)}; {amx})"


def render(result: dict[str, Any]) -> str:
    meta = result["meta"]
    labels = {k: MODELS[k].label for k in result["models"]}
    models = {k: m["runs"] for k, m in result["models"].items()}
    sizes = {k: m["bytes_per_token"] for k, m in result["models"].items()}
    bandwidth = {int(t): float(b) for t, b in result["bandwidth"].items()}
    best = max(bandwidth.values(), default=None)  # the limit: the fastest read measured
    lines = [
        f"Measured {meta['date']} on {meta['cpu']} ({meta['cores']} cores, "
        f"{meta['memory_gib']:.0f} GiB), both engines on {meta['threads']} threads, on the same "
        f"GGUF files and token ids, runs interleaved in one process tree: median of "
        f"{meta['rounds']} rounds (fresh processes: {meta['cold_rounds']}). Builds: neuron "
        f"{meta['neuron_commit']} (torch {meta['torch']}, dtype auto); {meta['llamacpp']}. "
        f"Regenerate: `{meta['command']}`.",
    ]
    if meta.get("note"):
        lines += ["", meta["note"]]
    lines += [
        "",
        table_format.markdown_table(
            table_format.COMPARISON_HEADER,
            table_format.comparison_rows(models, labels),
            "llrrrr",
        ),
        "",
        "neuron's advantage is neuron ÷ llama.cpp for tokens per second and llama.cpp ÷ neuron "
        "for times and memory: above 1.00× neuron is ahead. Runs: how many each median is of "
        "(neuron/llama.cpp).",
        "",
        "Roofline: a streaming read (torch sum over 1 GiB; the best of 10 reads, timed before "
        "the first model and after each) moves "
        + ", ".join(f"{b / 1e9:.1f} GB/s on {t} thread(s)" for t, b in sorted(bandwidth.items()))
        + "; the limit is the faster of these over the bytes each engine reads per decoded "
        "token (neuron: the buffers its decode kernels read; llama.cpp: the GGUF tensors, less "
        "the embedding table when the head is its own).",
        "",
        table_format.markdown_table(
            table_format.ROOFLINE_HEADER,
            table_format.roofline_rows(models, sizes, best, labels),
            "llrrrr",
        ),
    ]
    lines += speculation_section(result, best)
    errors = [f"{k}: {e}" for k, m in result["models"].items() for e in m["errors"]]
    if errors:
        lines += ["", "Failures during this run:", *[f"- {e.splitlines()[0]}" for e in errors]]
    return "\n".join(lines) + "\n"


def speculation_section(result: dict[str, Any], best: float | None) -> list[str]:
    """The speculation table's lines (none when no model has its runs)."""
    meta, models = result["meta"], result["models"]
    spec = {k: m["spec"] for k, m in models.items() if m.get("spec")}
    if not spec:
        return []
    answers = {k: m.get("spec_answers", {}) for k, m in models.items()}
    limits = {
        k: table_format.roofline_limit(best, m["bytes_per_token"].get("neuron"))
        for k, m in models.items()
    }
    labels = {k: MODELS[k].label if k in MODELS else k for k in spec}
    return [
        "",
        "Speculation: decode at batch 1 (tok/s after the first token; the prefill left out) of "
        f"one greedy chat answer of up to {meta['spec_tokens']} tokens, median of "
        f"{meta['spec_rounds']} rounds, the four arms alternated. Tasks (bench/prompts.py): "
        "rename a variable in a 60-line Python function, extract fields from a JSON "
        "document, quote sentences of a given text, and a free-form story. neuron + lookup: "
        f"its prompt-lookup speculation (adaptive, up to {meta['lookup_tokens']} tokens a "
        "draft, at batch 1 only); llama.cpp + lookup: llama-cpp-python's "
        "`LlamaPromptLookupDecoding` (max_ngram_size 2, "
        f"{meta['llamacpp_lookup_tokens']} tokens a draft) on its high-level `Llama`, and "
        "llama.cpp alone is the same `Llama` without it. Both get neuron's prompt token ids. "
        "The share is of neuron's roofline limit above; same greedy tokens: neuron's answer "
        "with the lookup against without.",
        "",
        table_format.markdown_table(
            table_format.SPEC_HEADER,
            table_format.speculation_rows(spec, answers, limits, labels),
            table_format.SPEC_ALIGN,
        ),
    ]


def regenerate_args(argv: list[str]) -> list[str]:
    """The command-line arguments that shape the table (not --note, --json: where it went)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--note", "--json"):
            skip = True
        elif not arg.startswith(("--note=", "--json=")):
            out.append(arg)
    return out


def measure_bandwidth(best: dict[str, float], threads: int) -> None:
    """Time the streaming read on 1 and `threads` threads; keep the fastest so far in `best`
    (keyed by the thread count as a string, as the JSON holds it)."""
    for t in sorted({1, threads}):
        best[str(t)] = max(best.get(str(t), 0.0), stream_bandwidth(t, repeats=10))
    rates = ", ".join(f"{t} thr {b / 1e9:.1f} GB/s" for t, b in best.items())
    print(f"stream bandwidth, best so far: {rates}", flush=True)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The options, and the model keys they name."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated keys")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (1 round)")
    parser.add_argument("--rounds", type=int, default=0, help="default 5 (quick: 1)")
    parser.add_argument("--cold-rounds", type=int, default=0, help="default 3 (quick: 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp-venv", type=Path, default=llamacpp_peer.default_venv())
    parser.add_argument("--json", type=Path, help="raw runs (bench/results/bench-table.json)")
    parser.add_argument("--note", default="", help="a line printed under the table's header")
    parser.add_argument("--spec-rounds", type=int, default=0, help="default 3 (quick: 1)")
    parser.add_argument("--spec-tokens", type=int, default=160, help="an answer's most tokens")
    parser.add_argument("--lookup-tokens", type=int, default=8, help="neuron's draft length")
    parser.add_argument(
        "--speculation-only", action="store_true", help="only the speculation rows (no README)"
    )
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args()
    if args.speculation_only and args.write_readme:
        parser.error("--speculation-only prints its rows; --write-readme needs the whole table")
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    return args, keys


def main() -> None:
    args, keys = parse_args()
    s = Settings(args)
    torch.set_num_threads(s.threads)
    command = " ".join(["python bench/bench_table.py", *regenerate_args(sys.argv[1:])])
    print(f"logs under {s.logs}", flush=True)
    bandwidth: dict[str, float] = {}
    measure_bandwidth(bandwidth, s.threads)
    result: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "memory_gib": memory_gib(),
            "threads": s.threads,
            "rounds": s.rounds,
            "cold_rounds": s.cold_rounds,
            "quick": s.quick,
            "torch": torch.__version__,
            "neuron_commit": git_commit(),
            "command": command.strip(),
            "note": args.note,
            "decode_tokens": s.decode_tokens,
            "stream_tokens": s.stream_tokens,
            "spec_rounds": s.spec_rounds,
            "spec_tokens": s.spec_tokens,
            "lookup_tokens": s.lookup_tokens,
            "llamacpp_lookup_tokens": table_lookup.NUM_PRED,
        },
        "bandwidth": bandwidth,
        "models": {},
    }
    peer_info: dict[str, Any] | None = None
    for key in keys:
        model = MODELS[key]
        path = model.resolve()
        print(f"{model.label}: {path}", flush=True)
        out: dict[str, Any] = {
            "path": str(path),
            "runs": {m.key: {side: [] for side in SIDES} for m in table_format.MEASURES},
            "bytes_per_token": {"llamacpp": gguf_decode_bytes(path)},
            "errors": [],
        }
        result["models"][key] = out
        try:
            if s.speculation_only:
                speculation_only(model, path, s, out)
            else:
                measure_model(model, path, s, out)
        except WorkerError as exc:
            out["errors"].append(f"neuron: {exc}")
        if not s.speculation_only:
            cold_starts(model, path, s, out)
        peer_info = peer_info or out.get("llamacpp_info")
        measure_bandwidth(bandwidth, s.threads)
    result["meta"]["llamacpp"] = llama_build(peer_info)
    if s.speculation_only:
        best = max(bandwidth.values(), default=None)
        markdown = "\n".join(speculation_section(result, best)).strip() + "\n"
    else:
        markdown = render(result)
    print(markdown)
    json_path = args.json or REPO / "bench" / "results" / "bench-table.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"raw runs: {json_path}")
    if args.write_readme:
        readme = REPO / "README.md"
        readme.write_text(table_format.replace_section(readme.read_text(), markdown))
        print("README.md: the bench-table section replaced")


if __name__ == "__main__":
    main()
