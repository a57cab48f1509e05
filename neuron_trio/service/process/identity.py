"""Who this process is across restarts: `boot_id`, `started_at`, `starts`.

`starts` counts the starts recorded in the state directory, this one included (the first
start is 1), so a router can tell a node that restarts every minute. The counter file is
replaced atomically (temporary file, fsync, `os.replace`, fsync of the directory): a crash
mid-write leaves the old count, never a torn one.

`previous_stop_clean` says whether the process before this one stopped cleanly: each start
writes `state_dir/running`, and only a clean stop (a drain that ended in exit 0) removes it.
A start that finds it follows a crash, a kill, an OOM, a deadman exit 70 or a failed start,
which `/metrics` exports (`neuron_node_previous_stop_clean`) for an alert on unexpected
restarts that a planned restart does not trip.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from neuron_trio.errors import ConfigError
from neuron_trio.service.documents.timefmt import utc_iso

log = logging.getLogger(__name__)

COUNTER_FILE = "starts"
RUNNING_FILE = "running"  # present from a start until its clean stop


class StateDirError(ConfigError):
    """Raised by `Identity.create` if the state directory cannot be created or written.

    A ConfigError (exit 78): a state directory that cannot be written will not fix itself on
    a restart, so systemd's `RestartPreventExitStatus=78` keeps it down.
    """


def _read_count(path: Path) -> int:
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return 0
    try:
        count = int(text)
        if count < 0:
            raise ValueError(text)
        return count
    except ValueError:
        # A damaged counter must not keep the node down: count again from here.
        log.warning("%s holds %r, not a count: counting starts from 0 again", path, text[:40])
        return 0


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class Identity:
    boot_id: str  # uuid4 hex, new every start
    started_at: str  # RFC 3339, UTC
    starts: int  # starts recorded in state_dir, this one included
    state_dir: Path
    previous_stop_clean: bool = True  # False: the last process did not stop cleanly

    @classmethod
    def create(cls, state_dir: str | Path, *, now: datetime | None = None) -> Identity:
        """Record this start in `state_dir` (created if missing). Raises StateDirError."""
        state = Path(state_dir)
        counter = state / COUNTER_FILE
        try:
            state.mkdir(parents=True, exist_ok=True)
            starts = _read_count(counter) + 1
            _write_atomically(counter, f"{starts}\n")
            running = state / RUNNING_FILE
            previous_clean = not running.exists()
            boot_id = uuid.uuid4().hex
            _write_atomically(running, f"{boot_id}\n")
        except OSError as exc:
            raise StateDirError(
                f"state directory {state}: cannot record this start in {counter}: "
                f"{exc.strerror or exc}"
            ) from None
        if not previous_clean:
            log.warning(
                "the previous neuron did not stop cleanly (%s was left behind): a crash, a kill, "
                "a deadman exit or a failed start; see the journal and state_dir/forensics",
                running,
            )
        return cls(
            boot_id=boot_id,
            started_at=utc_iso(now or datetime.now(UTC)),
            starts=starts,
            state_dir=state,
            previous_stop_clean=previous_clean,
        )

    def record_clean_stop(self) -> None:
        """After a drain that ends in exit 0: the next start is not an unexpected restart."""
        try:
            (self.state_dir / RUNNING_FILE).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot record a clean stop in %s: %s", self.state_dir, exc)

    def to_dict(self) -> dict[str, object]:
        return {"boot_id": self.boot_id, "started_at": self.started_at, "starts": self.starts}
