"""A real `neuron serve` in a child process, as the slow end-to-end tests start it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_neuron(
    config: Path, log_path: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`neuron serve --config CONFIG`, stdout and stderr to `log_path`.

    The environment is this one without any NEURON_* override (the test's config is the whole
    configuration), offline for the hub, plus `env`.
    """
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}
    child_env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    child_env.update(env or {})
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "neuron_trio.cli", "serve", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=REPO,
        )
