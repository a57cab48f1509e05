"""A live `nvidia-smi` read for forensics, bounded by its own timeout.

nvidia-smi itself can hang on a sick GPU (in the kernel, where even SIGKILL waits), so the
child is killed at the deadline and then waited for only briefly: a child that will not
die is abandoned, never waited on forever.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

QUERY_FIELDS = ("index", "uuid", "memory.used", "memory.total", "utilization.gpu")
DEFAULT_TIMEOUT_S = 5.0
_REAP_S = 1.0


def _number(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_csv(text: str) -> list[dict[str, Any]]:
    """Rows of `--query-gpu=…  --format=csv,noheader,nounits` to dicts."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(QUERY_FIELDS):
            continue
        index, uuid, used, total, util = cells
        gpus.append(
            {
                "index": _number(index),
                "uuid": uuid,
                "memory_used_mib": _number(used),
                "memory_total_mib": _number(total),
                "utilization_gpu_pct": _number(util),
            }
        )
    return gpus


def run_nvidia_smi(
    timeout_s: float = DEFAULT_TIMEOUT_S, *, executable: str = "nvidia-smi"
) -> dict[str, Any]:
    """`{"gpus": [...]}` read live from nvidia-smi, or `{"error": why}`; never raises."""
    path = shutil.which(executable)
    if path is None:
        return {"error": f"{executable} not found on PATH"}
    argv = [path, f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    except OSError as exc:
        return {"error": f"cannot run {path}: {exc}"}
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.communicate(timeout=_REAP_S)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel: abandon it
        return {"error": f"{executable} timed out after {timeout_s:g}s"}
    if proc.returncode != 0:
        detail = (err or out).strip().splitlines()
        why = detail[-1] if detail else "no output"
        return {"error": f"{executable} exited {proc.returncode}: {why}"}
    return {"gpus": parse_csv(out)}
