"""hypercorn's trio worker, configured from `[server]`: HTTP/1.1 and HTTP/2 on every address.

Cleartext: HTTP/1.1, HTTP/2 with prior knowledge and `Upgrade: h2c`, all on the same port
(hypercorn tells them apart by the connection preface). With `tls_cert` and `tls_key` every
address is TLS instead, with ALPN offering h2 and http/1.1.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from starlette.types import ASGIApp

from neuron_trio.config import NeuronConfig
from neuron_trio.http.wire._hypercorn_fixes import apply_hypercorn_fixes
from neuron_trio.http.wire.connections import ConnectionTable
from neuron_trio.http.wire.h2_floods import NodeFloodBudget

__all__ = ["BoundAddress", "RateLimitFilter", "hypercorn_config", "serve_http"]

log = logging.getLogger(__name__)

# Longer than the idle timeout of a typical client pool (60 s), so the client closes first
# and never sends on a connection the server is closing.
KEEP_ALIVE_TIMEOUT_S = 75.0
BACKLOG = 1024
TLS_HANDSHAKE_TIMEOUT_S = 10.0
# Rapid reset (CVE-2023-44487) is met with a rate, not a request count: a connection whose
# client resets more than H2_RESET_BURST streams in a burst, or more than H2_RESET_RATE_PER_S
# sustained, is closed with ENHANCE_YOUR_CALM (_hypercorn_fixes.py). A router cancelling the
# streams of clients that went away stays far below it.
H2_RESET_RATE_PER_S = 100.0
H2_RESET_BURST = 1000.0
# Control frames (PING, SETTINGS, PRIORITY, empty DATA, WINDOW_UPDATE with no data sent since
# the last, unknown frames) per connection: honest clients send a handful; a flood is told
# ENHANCE_YOUR_CALM (h2_floods.py). Before: 500,000 PINGs were all answered.
H2_CONTROL_RATE_PER_S = 50.0
H2_CONTROL_BURST = 200.0
# The node-wide budget, shared by every connection (control frames and resets together): many
# connections flooding just under their own limits (50 x 1,000 resets cost 15 s of CPU) meet
# this one; then only connections that spent more than H2_FLOOD_GRACE lately are closed.
H2_NODE_RATE_PER_S = 200.0
H2_NODE_BURST = 500.0
# Stream resets have a node-wide budget of their own: each reset stream costs ~1.3 ms of CPU
# (its request task, the middleware, its access-log line), so at 200/s 50 connections x 1,000
# resets still got 7,076 through and cost 9.3 s (issue 47). A router cancelling the streams
# of clients that went away needs a few a second, and a connection resetting at most 5/s
# (`FloodGuard.grace_rate`) is never closed for this budget.
H2_NODE_RESET_RATE_PER_S = 20.0
H2_NODE_RESET_BURST = 100.0
H2_FLOOD_GRACE = 20.0
# trio logs every failed accept(2) (EMFILE: out of descriptors) with a traceback, ten times a
# second; keep one line per this many seconds, with a count of those dropped.
ACCEPT_ERROR_LOG_INTERVAL_S = 10.0


class RateLimitFilter(logging.Filter):
    """Passes one record per `interval_s` (without its traceback); counts the rest, and says
    how many were dropped on the next one that passes."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self.last: float | None = None
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.interval_s:
            self.dropped += 1
            return False
        self.last = now
        record.exc_info = None
        record.exc_text = None
        if self.dropped:
            record.msg = f"{record.msg} ({self.dropped} more like it in the last %.0f s)"
            record.args = (*(record.args or ()), self.interval_s)  # type: ignore[misc]
            self.dropped = 0
        return True


def limit_accept_error_logging() -> None:
    """Install the RateLimitFilter on trio's accept-loop logger once."""
    logger = logging.getLogger("trio.serve_listeners")
    if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
        logger.addFilter(RateLimitFilter(ACCEPT_ERROR_LOG_INTERVAL_S))


@dataclass(frozen=True)
class BoundAddress:
    """One listening socket, with the real port (a configured port 0 becomes the kernel's)."""

    scheme: str  # "http" or "https"
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def __str__(self) -> str:
        return self.url

    @classmethod
    def parse(cls, url: str) -> BoundAddress:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"not a bound address: {url!r}")
        return cls(parts.scheme, parts.hostname, parts.port)


def hypercorn_config(config: NeuronConfig) -> HypercornConfig:
    """hypercorn's settings for `config.server`; the drain timeout is the graceful timeout."""
    server = config.server
    hc = HypercornConfig()
    hc.bind = list(server.listen)
    if server.tls_cert is not None and server.tls_key is not None:
        hc.certfile = server.tls_cert
        hc.keyfile = server.tls_key
        hc.alpn_protocols = ["h2", "http/1.1"]
    hc.graceful_timeout = server.drain_timeout_s
    hc.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    # hypercorn's default (1000) closes an HTTP/2 connection, streams in flight included,
    # after that many requests: a router's connection lives for days. No count, then; rapid
    # reset is limited by rate instead (below).
    hc.keep_alive_max_requests = sys.maxsize
    # Read by _hypercorn_fixes (hypercorn's Config has no such settings of its own).
    hc.h2_reset_rate_per_s = H2_RESET_RATE_PER_S  # type: ignore[attr-defined]
    hc.h2_reset_burst = H2_RESET_BURST  # type: ignore[attr-defined]
    hc.h2_control_rate_per_s = H2_CONTROL_RATE_PER_S  # type: ignore[attr-defined]
    hc.h2_control_burst = H2_CONTROL_BURST  # type: ignore[attr-defined]
    hc.h2_flood_grace = H2_FLOOD_GRACE  # type: ignore[attr-defined]
    hc.h2_flood_budget = NodeFloodBudget(  # type: ignore[attr-defined]
        H2_NODE_RATE_PER_S, H2_NODE_BURST, H2_NODE_RESET_RATE_PER_S, H2_NODE_RESET_BURST
    )
    hc.connection_table = ConnectionTable(  # type: ignore[attr-defined]
        server.max_connections, server.max_connections_per_peer
    )
    # No hypercorn read_timeout: it counts silence on the whole connection, and a client
    # reading a long generation sends nothing for minutes. Idle connections close after
    # keep_alive_timeout; a request body that stalls gets 408 (server.read_timeout_s).
    hc.backlog = BACKLOG
    hc.ssl_handshake_timeout = TLS_HANDSHAKE_TIMEOUT_S
    hc.include_server_header = False
    hc.accesslog = None
    hc.errorlog = logging.getLogger("neuron_trio.http.hypercorn")
    return hc


async def serve_http(
    app: ASGIApp,
    config: NeuronConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[BoundAddress]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on every `server.listen` address until `shutdown_trigger()` returns.

    Reports the bound addresses (real ports) through `task_status.started` once every
    socket listens. On shutdown the listeners close at once, idle connections close, and
    responses in flight get `server.drain_timeout_s` to finish before they are cut.
    Raises OSError if an address cannot be bound.
    """
    apply_hypercorn_fixes()
    limit_accept_error_logging()
    hc = hypercorn_config(config)
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(serve, cast(Any, app), hc, shutdown_trigger=shutdown_trigger)
        )
        bound = [BoundAddress.parse(b) for b in binds]
        log.info("listening on %s", ", ".join(b.url for b in bound))
        task_status.started(bound)
