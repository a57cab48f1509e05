"""sd_notify by hand: READY=1, STATUS=…, WATCHDOG=1, EXTEND_TIMEOUT_USEC=…, STOPPING=1.

The protocol is one unix datagram per message (newline-separated `KEY=value` lines) to the
path in `$NOTIFY_SOCKET`; a leading `@` names an abstract socket (replaced by NUL). The
socket is non-blocking: a full or vanished systemd socket costs a log line, never a stall
of the event loop. Without `$NOTIFY_SOCKET` (not under systemd) every call is a no-op.
Thread-safe: download progress is reported from a worker thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping

import trio

log = logging.getLogger(__name__)

SENT_KEPT = 100  # progress reports every second would otherwise grow the list forever


def _address(raw: str) -> str:
    return "\0" + raw[1:] if raw.startswith("@") else raw


def watchdog_interval_s(environ: Mapping[str, str]) -> float | None:
    """Half of `$WATCHDOG_USEC`, when systemd asks this process for pings; else None."""
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None  # the pings are asked of another process
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2 / 1_000_000 if value > 0 else None


class Notifier:
    """Talks to systemd. `environ` defaults to `os.environ` (read once, here)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = _address(raw) if raw else None
        self.watchdog_interval_s = watchdog_interval_s(env) if self.address else None
        self._sock: socket.socket | None = None
        self._failed = False
        self._lock = threading.Lock()
        self.sent: list[str] = []  # the last SENT_KEPT messages, for tests and status pages

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send one datagram of `lines`; True if it left. Never raises, never blocks."""
        if self.address is None:
            return False
        message = "\n".join(lines)
        with self._lock:
            return self._send(message)

    def _send(self, message: str) -> bool:
        assert self.address is not None
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(message.encode(), self.address)
        except OSError as exc:
            if not self._failed:  # once: a dead notify socket would otherwise flood the log
                log.warning("sd_notify to %r failed: %s", self.address, exc)
                self._failed = True
            return False
        self._failed = False
        self.sent.append(message)
        if len(self.sent) > SENT_KEPT:
            del self.sent[0]
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        # A newline would start a new KEY=value line: keep the status on one line.
        return self.notify("STATUS=" + " ".join(text.splitlines()))

    def extend_timeout(self, seconds: float, status: str | None = None) -> bool:
        """EXTEND_TIMEOUT_USEC: the current start (or stop) may take `seconds` more from now.

        Only while starting: sent during a stop, it would stretch TimeoutStopSec= as well.
        """
        # STATUS= first: whoever reads the datagrams for progress finds it where a plain
        # status() puts it.
        lines = ["STATUS=" + " ".join(status.splitlines())] if status else []
        lines.append(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")
        return self.notify(*lines)

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def run(
        self, *, task_status: trio.TaskStatus[Notifier] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The watchdog pinger: WATCHDOG=1 every half `$WATCHDOG_USEC`, from the trio loop.

        The pings come from the event loop on purpose: a stalled loop stops them, and
        systemd's `WatchdogSec=` then kills and restarts the process.
        """
        task_status.started(self)
        try:
            interval = self.watchdog_interval_s
            if interval is None:
                await trio.sleep_forever()
                return
            log.info("systemd watchdog: pinging every %.1fs", interval)
            while True:
                self.watchdog()
                await trio.sleep(interval)
        finally:
            self.close()
