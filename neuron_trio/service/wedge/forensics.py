"""The forensics report the deadman writes before exit 70 (format in docs/DESIGN.md).

Plain threading code, no trio: the deadman may gather from a worker thread, or from a
thread that is not trio's at all. Every part that talks to something outside the
interpreter (nvidia-smi, NVML, a communicator) runs under its own timeout on a daemon
thread, so that gathering cannot hang the exit: a part that overruns is recorded as
`{"error": "timed out after N s"}` and its thread is left behind (the process is about
to exit anyway).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

from neuron_trio.gpu.nvml import GpuProbe, NvmlProbe
from neuron_trio.gpu.smi import run_nvidia_smi
from neuron_trio.service.documents.timefmt import utc_iso

T = TypeVar("T")

FORENSICS_DIR = "forensics"


class _Comm(Protocol):
    def async_error(self) -> str | None: ...

    def describe(self) -> dict[str, object]: ...


class PartTimeout(Exception):
    """Raised by `bounded` if a part did not finish within its timeout."""


def bounded(fn: Callable[[], T], timeout_s: float, *, name: str) -> T:
    """Run `fn` on a daemon thread named `name`; return its value or raise what it raised.

    Raises PartTimeout if it is still running after `timeout_s`; the thread is then left
    behind (a daemon thread never holds up the exit).
    """
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise PartTimeout(f"timed out after {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def _part(fn: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """A report part: its value, or {"error": why}, never an exception."""
    try:
        return bounded(fn, timeout_s, name=f"forensics-{name}")
    except Exception as exc:
        return {
            "error": f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, PartTimeout)
            else str(exc)
        }


class ThreadStack(msgspec.Struct, frozen=True):
    """One Python thread in the report: its name and stack, innermost frame last."""

    name: str
    ident: int
    daemon: bool | None  # None: a thread `threading` does not know
    stack: list[str]  # "file:line in function: source"


class ForensicsReport(msgspec.Struct, kw_only=True):
    """The report the deadman writes (format in docs/DESIGN.md). Parts that are not there are
    absent from the JSON (UNSET): a minimal report, when gathering failed, has no GPU parts,
    and the deadman adds where it was written (or why not) and the exit code last."""

    kind: str = "neuron.forensics"
    version: int = 1
    reason: str
    what: str
    since: str | None  # when the wedged call started (UTC)
    wedged_for_s: float | msgspec.UnsetType | None = msgspec.UNSET
    deadlines_s: dict[str, float] | float | None
    at: str | msgspec.UnsetType = msgspec.UNSET  # when the report was gathered (UTC)
    pid: int
    inflight: list[Any] | msgspec.UnsetType = msgspec.UNSET  # requests in flight (now)
    inflight_count: int | msgspec.UnsetType = msgspec.UNSET
    nvidia_smi: Any = msgspec.UNSET  # each part: its value, or {"error": why}
    nvml: Any = msgspec.UNSET
    nccl: list[Any] | msgspec.UnsetType = msgspec.UNSET  # one part per communicator
    extra: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    threads: list[ThreadStack] | dict[str, str]  # {"error": why} if they could not be read
    inflight_at_wedge: list[Any] | msgspec.UnsetType = msgspec.UNSET  # failed with 503 since
    gather_error: str | msgspec.UnsetType = msgspec.UNSET  # why this report is minimal
    exit_code: int | msgspec.UnsetType = msgspec.UNSET
    written_to: str | msgspec.UnsetType = msgspec.UNSET
    write_error: str | msgspec.UnsetType = msgspec.UNSET


def thread_stacks() -> list[ThreadStack]:
    """The stack of every Python thread, innermost frame last, with its name."""
    frames = sys._current_frames()
    by_ident = {t.ident: t for t in threading.enumerate()}
    stacks = []
    for ident, frame in frames.items():
        thread = by_ident.get(ident)
        stacks.append(
            ThreadStack(
                name=thread.name if thread else f"<unknown {ident}>",
                ident=ident,
                daemon=thread.daemon if thread else None,
                stack=[
                    f"{fs.filename}:{fs.lineno} in {fs.name}: {(fs.line or '').strip()}"
                    for fs in traceback.extract_stack(frame)
                ],
            )
        )
    del frames
    stacks.sort(key=lambda s: s.name)
    return stacks


def read_gpus(probe: GpuProbe | None, timeout_s: float) -> dict[str, Any]:
    """The GPUs as gpu/nvml.py reads them (the one NVML reader: bounded on its own thread,
    never raises): per-GPU memory, utilisation and temperature, or why they could not be
    read (`reason`, and `error` for a failed or timed-out read)."""
    return (probe or NvmlProbe()).read_sync(timeout_s).to_dict()


def _comm_part(comm: _Comm) -> dict[str, Any]:
    part: dict[str, Any] = {}
    try:
        part["describe"] = comm.describe()
    except Exception as exc:
        part["describe"] = {"error": f"{type(exc).__name__}: {exc}"}
    part["async_error"] = comm.async_error()
    return part


def gather_forensics(
    *,
    what: str,
    since: float | None,
    deadline_s: dict[str, float] | float | None,
    inflight: list[Any] | None = None,
    comms: Iterable[_Comm] = (),
    nvidia_smi_timeout_s: float = 5.0,
    part_timeout_s: float = 5.0,
    reason: str = "",
    extra: dict[str, Any] | None = None,
    now: float | None = None,
    gpu_probe: GpuProbe | None = None,
) -> ForensicsReport:
    """Build the report. `since` and `now` are wall-clock (time.time()) seconds.

    Bounded: nvidia-smi by `nvidia_smi_timeout_s` (plus a second to reap it), NVML (through
    `gpu_probe`, a fresh NvmlProbe if None) and each communicator by `part_timeout_s`. The thread stacks are read last, so that the report's
    own helper threads (still hung, if one timed out) show too.
    """
    now = time.time() if now is None else now
    inflight = list(inflight or [])
    # gpu.smi kills and reaps a hung nvidia-smi itself; the extra bound covers a child that
    # cannot be reaped (stuck in the kernel on a sick GPU).
    nvidia_smi = _part(
        lambda: run_nvidia_smi(nvidia_smi_timeout_s), nvidia_smi_timeout_s + 2.0, "nvidia-smi"
    )
    nvml = read_gpus(gpu_probe, part_timeout_s)
    nccl = [
        _part(lambda c=comm: _comm_part(c), part_timeout_s, f"comm-{i}")  # type: ignore[misc]
        for i, comm in enumerate(comms)
    ]
    return ForensicsReport(
        reason=reason,
        what=what,
        since=utc_iso(since) if since is not None else None,
        wedged_for_s=round(now - since, 3) if since is not None else None,
        deadlines_s=deadline_s,
        at=utc_iso(now),
        pid=os.getpid(),
        inflight=inflight,
        inflight_count=len(inflight),
        nvidia_smi=nvidia_smi,
        nvml=nvml,
        nccl=nccl,
        extra=extra if extra else msgspec.UNSET,
        threads=thread_stacks(),
    )


def report_filename(ts: float) -> str:
    """`20261202T171727.123456Z.json`: sorts by time; the UTC instant of the report."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y%m%dT%H%M%S.%fZ") + ".json"


def to_json(report: object) -> str:
    """One line of JSON (no newlines inside): the log record and the file's content.

    Structs (in-flight requests, watchdog statistics) encode as objects; anything else JSON
    cannot hold becomes its repr, never an error (this runs on the way to exit 70).
    """
    try:
        return _encoder.encode(report).decode("utf-8")
    except Exception:  # e.g. a lone surrogate in a thread's stack text
        builtins = msgspec.to_builtins(report, enc_hook=repr)
        return json.dumps(builtins, default=repr, separators=(",", ":"), ensure_ascii=False)


_encoder = msgspec.json.Encoder(enc_hook=repr)


def write_report(state_dir: str | Path, report: object, *, now: float | None = None) -> Path:
    """Write `state_dir/forensics/<utc-timestamp>.json` atomically (temp file, fsync, rename)."""
    folder = Path(state_dir) / FORENSICS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / report_filename(time.time() if now is None else now)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".forensics-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(to_json(report) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path


class LastForensics(msgspec.Struct, frozen=True, kw_only=True):
    """The newest forensics report found at start-up (`/v1/node` `last_forensics`)."""

    path: str = ""
    report: Any = None  # as written; {"unreadable": why} if it could not be read


def find_last_forensics(state_dir: Path) -> LastForensics | None:
    """The newest report under `state_dir/forensics/`, with its path, or None."""
    folder = state_dir / FORENSICS_DIR
    try:
        reports = sorted(folder.glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
    except OSError:
        return None
    if not reports:
        return None
    newest = reports[-1]
    try:
        report: Any = json.loads(newest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        report = {"unreadable": f"{type(exc).__name__}: {exc}"}
    return LastForensics(path=str(newest), report=report)
