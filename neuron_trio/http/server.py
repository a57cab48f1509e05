"""hypercorn's trio worker, configured from `[server]`: HTTP/1.1 and HTTP/2 on every address.

Cleartext: HTTP/1.1, HTTP/2 with prior knowledge and `Upgrade: h2c`, all on the same port
(hypercorn tells them apart by the connection preface). With `tls_cert` and `tls_key` every
address is TLS instead, with ALPN offering h2 and http/1.1.
"""

from __future__ import annotations

import logging
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
from neuron_trio.http._hypercorn_fixes import apply_hypercorn_fixes

__all__ = ["BoundAddress", "hypercorn_config", "serve_http"]

log = logging.getLogger(__name__)

# Longer than the idle timeout of a typical client pool (60 s), so the client closes first
# and never sends on a connection the server is closing.
KEEP_ALIVE_TIMEOUT_S = 75.0
BACKLOG = 1024
TLS_HANDSHAKE_TIMEOUT_S = 10.0


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
    hc = hypercorn_config(config)
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(serve, cast(Any, app), hc, shutdown_trigger=shutdown_trigger)
        )
        bound = [BoundAddress.parse(b) for b in binds]
        log.info("listening on %s", ", ".join(b.url for b in bound))
        task_status.started(bound)
