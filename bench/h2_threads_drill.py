"""Six threads, one httpx HTTP/2 connection, many rounds: the case that once failed with a
broken pipe while the node logged three 499s (issue 46). Prints, per round that failed, which
request raised what, and at the end the failures by kind and the daemon's 499 access lines
and connection-closing log lines, so that who closed the connection can be read off.

    python bench/h2_threads_drill.py [--rounds 300] [--threads 6] [--url URL --log PATH]
        [--client threads|async] [--httpcore-log PATH]

Without --url it starts its own daemon on the built-in model (tests/neuron_process.py).
`--client async` runs the same requests as tasks of one `httpx.AsyncClient` (one HTTP/2
connection, one thread): the comparison that tells the client's threads from the server.
`--httpcore-log` writes httpcore's and h2's debug log (the client's side of every frame).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.neuron_process import BUILTIN_MODEL, builtin_daemon

PROMPTS = ["Write a very long book.", "Write another a poem.", "What is LLM?"]


def _one(client: httpx.Client, i: int, max_tokens: int) -> str:
    body = {"model": BUILTIN_MODEL, "prompt": PROMPTS[i % 3], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": i}  # fmt: skip
    try:
        r = client.post("/v1/completions", json=body)
    except Exception as exc:  # what the client saw, by kind
        cause = exc.__cause__ or exc.__context__
        return f"{type(exc).__name__}: {exc}" + (f" <- {type(cause).__name__}" if cause else "")
    return "ok" if r.status_code == 200 else f"status {r.status_code}"


def drill(url: str, rounds: int, threads: int, max_tokens: int) -> collections.Counter[str]:
    kinds: collections.Counter[str] = collections.Counter()
    with (
        httpx.Client(base_url=url, http1=False, http2=True, timeout=120) as client,
        ThreadPoolExecutor(threads) as pool,
    ):
        for n in range(rounds):
            got = list(pool.map(lambda i: _one(client, i, max_tokens), range(threads)))
            kinds.update(got)
            bad = [g for g in got if g != "ok"]
            if bad:
                print(f"round {n}: {bad}", flush=True)
    return kinds


async def _one_async(client: httpx.AsyncClient, i: int, max_tokens: int) -> str:
    body = {"model": BUILTIN_MODEL, "prompt": PROMPTS[i % 3], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": i}  # fmt: skip
    try:
        r = await client.post("/v1/completions", json=body)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok" if r.status_code == 200 else f"status {r.status_code}"


def drill_async(url: str, rounds: int, tasks: int, max_tokens: int) -> collections.Counter[str]:
    async def run() -> collections.Counter[str]:
        kinds: collections.Counter[str] = collections.Counter()
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True, timeout=120) as c:
            for n in range(rounds):
                got = await asyncio.gather(*(_one_async(c, i, max_tokens) for i in range(tasks)))
                kinds.update(got)
                bad = [g for g in got if g != "ok"]
                if bad:
                    print(f"round {n}: {bad}", flush=True)
        return kinds

    return asyncio.run(run())


def _log_lines(log: Path) -> list[str]:
    text = log.read_text(errors="replace") if log.exists() else ""
    keep = re.compile(r" 499 |GOAWAY|closing|closed|ENHANCE_YOUR_CALM|Traceback|ERROR")
    return [line for line in text.splitlines() if keep.search(line)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--url")
    ap.add_argument("--log", type=Path)
    ap.add_argument("--client", choices=["threads", "async"], default="threads")
    ap.add_argument("--httpcore-log", type=Path)
    args = ap.parse_args()
    if args.httpcore_log:
        handler = logging.FileHandler(args.httpcore_log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(message)s"))
        for name in ("httpcore.http2", "hpack", "h2"):
            logging.getLogger(name).setLevel(logging.DEBUG)
            logging.getLogger(name).addHandler(handler)
    run = drill if args.client == "threads" else drill_async
    started = time.perf_counter()
    if args.url:
        kinds = run(args.url, args.rounds, args.threads, args.max_tokens)
        log = args.log
    else:
        with tempfile.TemporaryDirectory() as tmp, builtin_daemon(Path(tmp)) as (url, _):
            kinds = run(url, args.rounds, args.threads, args.max_tokens)
            lines = _log_lines(Path(tmp) / "neuron.log")
        log = None
    if log is not None:
        lines = _log_lines(log)
    took = time.perf_counter() - started
    print(f"{args.client}: {args.rounds} rounds x {args.threads} in {took:.0f} s: {dict(kinds)}")
    print(f"daemon log lines of interest: {len(lines)}")
    for line in lines[:40]:
        print("  " + line)


if __name__ == "__main__":
    main()
