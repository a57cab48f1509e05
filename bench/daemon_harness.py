"""A real `neuron serve` for the benches: a config written to a temporary directory, the child
started, `/health` polled until 200; its RSS read from /proc; stopped with SIGTERM.

Used by bench_startup.py, bench_http.py and bench_ttft.py (run them as scripts: this file sits
beside them on sys.path). The child is started as the tests start it (`tests/neuron_process.py`,
standard library only). The client side is the standard library (http.client) here and httpx
in the HTTP/2 benches; nothing from neuron_trio is imported in the parent, so the child's
start-up is measured from a cold interpreter.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on the path, the repository is not
    sys.path.insert(0, str(REPO))

from tests.neuron_process import free_port, spawn_neuron, stop_neuron, wait_ready  # noqa: E402
from tests.neuron_process import write_config as neuron_config  # noqa: E402

MODEL = "smollm2-135m"


def write_config(
    path: Path,
    state: Path,
    port: int,
    model: Mapping[str, Any],
    model_file: Path | None = None,
    node: Mapping[str, Any] | None = None,
    model_dirs: Sequence[Path] = (),
) -> None:
    """A config with one default model: the built-in one (or the GGUF `model_file`, served
    under the same name, its folder a model dir), with `model`'s keys on top, and `node`'s
    keys in `[node]` (a `source` that is a local path must lie under one of `model_dirs`).

    A key the daemon does not know (e.g. `prefix_cache` before it lands) makes it exit 78, which
    `Daemon.start` reports with the daemon's own message.
    """
    source = f"builtin:{MODEL}" if model_file is None else str(model_file.resolve())
    entry = {"name": MODEL, "source": source, "devices": "cpu", **model}
    dirs = [state, *model_dirs]
    if model_file is not None:
        dirs.append(model_file.resolve().parent)
    neuron_config(
        path,
        server={"listen": [f"127.0.0.1:{port}"], "drain_timeout_s": 5},
        node={"state_dir": state, "model_dirs": dirs, **(node or {})},
        models=[entry],
    )


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def get_json(port: int, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        return response.status, json.loads(body) if body else None
    finally:
        conn.close()


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    port: int
    ready_s: float  # from just before exec to the first /health 200
    ready_cpu_s: float  # CPU time the daemon had used by then (less noisy on a busy machine)
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def running_daemon(
    model: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    state_dir: Path | None = None,
    model_file: Path | None = None,
    node: Mapping[str, Any] | None = None,
    model_dirs: Sequence[Path] = (),
) -> Iterator[Daemon]:
    """`neuron serve` on a free 127.0.0.1 port with the built-in model (or `model_file`; and
    `model`'s keys; `node`'s in `[node]`), ready (`/health` 200) when this yields; SIGTERM
    (then SIGKILL) on the way out.

    `state_dir`: the node's state directory, kept between runs; default a
    fresh one, removed afterwards. `model_dirs`: where a local `source` may lie."""
    with tempfile.TemporaryDirectory(prefix="neuron-bench-") as tmp:
        root = Path(tmp)
        port = free_port()
        config = root / "neuron.toml"
        write_config(
            config, state_dir or root / "state", port, model or {}, model_file, node, model_dirs
        )
        log_path = root / "neuron.log"
        started = time.perf_counter()
        process = spawn_neuron(config, log_path, env)
        try:
            wait_ready(process, port, log_path, timeout_s)
            ready_s = time.perf_counter() - started
            yield Daemon(process, port, ready_s, cpu_seconds(process.pid), log_path)
        finally:
            stop_neuron(process)
