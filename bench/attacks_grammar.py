"""Issue 25's structured-output attacks, replayed against a running neuron: one row each.

Each attack is a function `attack(base_url, pid=None) -> AttackRow` (`ATTACKS` lists them;
the row is bench/attack_rows.py's, so that bench/attack_drill.py prints them with its own); `pid` (the daemon's
process id, when known) adds RSS and a liveness check beside `/health`:

- const_schema_response_format / const_schema_tool_parameters: `{"const": {30 000 keys}}`
  (~480 KB): a SIGSEGV in the grammar compiler before; now a 400 naming the field.
- distinct_big_schemas: ten distinct ~200 KB `const` schemas (~640 MB of RSS each before).
- distinct_schemas_at_the_bounds: twenty distinct schemas just inside the bounds, which
  compile (~35 MB each): the grammar cache's byte budget holds the growth.
- abandoned_compiles: sixty heavy distinct schemas sent, their clients gone after 0.3 s,
  while a long chat runs: its latency against the same chat alone, same run.

Run: `python bench/attacks_grammar.py` (starts the built-in model with
bench/daemon_harness.py) or `python bench/attacks_grammar.py --url http://HOST:PORT --pid PID`.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from attack_rows import AttackRow, print_rows  # beside this file (bench/ is on the path)

__all__ = ["ATTACKS", "main", "run_all"]


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def _cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of `pid` so far: what an attack cost the node, whatever
    else loads the machine."""
    if pid is None:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(base_url: str, pid: int | None) -> bool:
    if pid is not None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    try:
        return httpx.get(f"{base_url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _model(base_url: str) -> str:
    models = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
    return str(models[0]["id"])


@contextmanager
def _health_watch() -> Iterator[Callable[[str], float]]:
    """Polls /health every 0.2 s while the block runs; yields a setter for the URL and,
    afterwards, the slowest answer (seconds) through the returned function."""
    worst = [0.0]
    url: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            if url:
                started = time.perf_counter()
                try:
                    httpx.get(url[0], timeout=30)
                except httpx.HTTPError:
                    pass
                worst[0] = max(worst[0], time.perf_counter() - started)
            stop.wait(0.2)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()

    def watch(base_url: str) -> float:
        url[:] = [f"{base_url}/health"]
        return worst[0]

    try:
        yield watch
    finally:
        stop.set()
        thread.join(35)


def _chat(base_url: str, model: str, extra: dict[str, Any], timeout: float = 120) -> int | str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 1,
        **extra,
    }
    try:
        return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout).status_code
    except httpx.TimeoutException:
        return "gone"  # the client left: what the attacker does
    except httpx.HTTPError:
        return "error"


def _row(
    name: str,
    base_url: str,
    pid: int | None,
    codes: list[int | str],
    rss_before_mb: float | None,
    health_max_s: float,
    detail: str,
) -> AttackRow:
    """The attack's row: its status codes ("error" for a connection that failed), whether the
    daemon survived (alive, /health 200), its RSS growth and the slowest /health."""
    after = _rss_mb(pid)
    return AttackRow(
        name,
        Counter(map(str, codes)),
        detail,
        rss_growth_mb=None if rss_before_mb is None or after is None else after - rss_before_mb,
        health_p_max_s=health_max_s,
        survived=_alive(base_url, pid),
    )


def _json_schema(schema: Any, strict: bool = False) -> dict[str, Any]:
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema, "strict": strict},
        }
    }


def _tool(parameters: Any) -> dict[str, Any]:
    function = {"name": "f", "parameters": parameters}
    return {
        "tools": [{"type": "function", "function": function}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }


def _const(keys: int, tag: str = "") -> dict[str, Any]:
    return {"const": {f"{tag}k{i}": i for i in range(keys)}}


def _run(
    name: str, base_url: str, pid: int | None, bodies: list[dict[str, Any]], detail: str
) -> AttackRow:
    model = _model(base_url)
    before = _rss_mb(pid)
    with _health_watch() as watch:
        watch(base_url)
        codes = [_chat(base_url, model, body) for body in bodies]
        worst = watch(base_url)
    return _row(name, base_url, pid, codes, before, worst, detail)


def const_schema_response_format(base_url: str, pid: int | None = None) -> AttackRow:
    body = _json_schema(_const(30_000))
    size = len(json.dumps(body)) // 1024
    return _run("const 30k keys (response_format)", base_url, pid, [body], f"{size} KB")


def const_schema_tool_parameters(base_url: str, pid: int | None = None) -> AttackRow:
    body = _tool(_const(30_000))
    size = len(json.dumps(body)) // 1024
    return _run("const 30k keys (tool parameters)", base_url, pid, [body], f"{size} KB")


def distinct_big_schemas(base_url: str, pid: int | None = None) -> AttackRow:
    bodies = [_json_schema(_const(13_000, f"s{i}")) for i in range(10)]
    size = len(json.dumps(bodies[0])) // 1024
    return _run("10 distinct ~200 KB schemas", base_url, pid, bodies, f"{size} KB each")


def distinct_schemas_at_the_bounds(base_url: str, pid: int | None = None) -> AttackRow:
    bodies = [_json_schema(_const(1_999, f"s{i}")) for i in range(20)]
    size = len(json.dumps(bodies[0])) // 1024
    return _run(
        "20 distinct schemas at the bounds", base_url, pid, bodies, f"{size} KB each, compiled"
    )


LONG_CHAT = {
    "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    "max_tokens": 48,
    "temperature": 0,
}


def _long_chat_s(base_url: str, model: str) -> float:
    started = time.perf_counter()
    response = httpx.post(
        f"{base_url}/v1/chat/completions", json={"model": model, **LONG_CHAT}, timeout=600
    )
    response.raise_for_status()
    return time.perf_counter() - started


def abandoned_compiles(base_url: str, pid: int | None = None, n: int = 60) -> AttackRow:
    model = _model(base_url)
    _long_chat_s(base_url, model)  # warm
    with _health_watch() as watch:
        watch(base_url)
        cpu0 = _cpu_s(pid)
        alone = _long_chat_s(base_url, model)
        cpu1 = _cpu_s(pid)
        health_alone = watch(base_url)
    before = _rss_mb(pid)
    heavy = [_json_schema(_const(1_999, f"a{i}")) for i in range(n)]  # at the bounds
    with _health_watch() as watch, ThreadPoolExecutor(n) as pool:
        watch(base_url)
        sent = [pool.submit(_chat, base_url, model, body, 0.3) for body in heavy]
        codes = [f.result() for f in sent]  # every client gone after 0.3 s
        during = _long_chat_s(base_url, model)
        time.sleep(10)  # compiles still running go on costing: count them
        cpu2 = _cpu_s(pid)
        worst = watch(base_url)
    detail = (
        f"long chat {alone:.2f} s alone (/health max {health_alone:.2f} s), {during:.2f} s "
        f"after {n} abandoned compiles"
    )
    if cpu0 is not None and cpu1 is not None and cpu2 is not None:
        attack_cpu_s = (cpu2 - cpu1) - (cpu1 - cpu0)  # beyond the chat's own
        detail += f"; the attack cost {attack_cpu_s:.1f} CPU s"
    return _row(f"{n} heavy compiles abandoned", base_url, pid, codes, before, worst, detail)


ATTACKS: list[Callable[..., AttackRow]] = [
    const_schema_response_format,
    const_schema_tool_parameters,
    distinct_big_schemas,
    distinct_schemas_at_the_bounds,
    abandoned_compiles,
]


def run_all(base_url: str, pid: int | None = None) -> list[AttackRow]:
    return [attack(base_url, pid) for attack in ATTACKS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running neuron (default: start the built-in model)")
    parser.add_argument("--pid", type=int, help="its process id (RSS and liveness)")
    parser.add_argument("--only", help="one attack, by its function's name")
    args = parser.parse_args()
    attacks = [a for a in ATTACKS if args.only in (None, a.__name__)]

    def run(url: str, pid: int | None) -> None:
        print_rows([attack(url, pid) for attack in attacks])

    if args.url:
        run(args.url.rstrip("/"), args.pid)
        return
    from daemon_harness import running_daemon  # beside this file when run as a script

    with running_daemon({"context": 1024, "max_batch": 4}) as daemon:
        run(daemon.url, daemon.pid)


if __name__ == "__main__":
    main()
