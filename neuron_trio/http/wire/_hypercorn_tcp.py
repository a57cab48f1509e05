"""hypercorn fixes 4, 5 and 8: the trio server's connections (the connection table, a
closed peer's socket closed at once) and HTTP/1.1's answer to a peer that has gone."""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.events import RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

from neuron_trio.http.wire._hypercorn_shape import (
    Patch,
    attributes_problem,
    first,
    method_problem,
)
from neuron_trio.http.wire.connections import ConnectionEntry, ConnectionTable


def _peer_of(stream: Any) -> str:
    """The peer's address (host only) of a trio SocketStream or SSLStream; "?" if unknown."""
    transport = getattr(stream, "transport_stream", stream)
    try:
        return str(transport.socket.getpeername()[0])
    except (AttributeError, OSError, IndexError):
        return "?"


async def _close_transport(stream: Any) -> None:
    """Close a connection from outside its task: the socket under any TLS, so that its task's
    pending receive fails at once (trio wakes it with ClosedResourceError)."""
    await trio.aclose_forcefully(getattr(stream, "transport_stream", stream))


# --- fix 4 --------------------------------------------------------------------------------------


def fix_4_shape() -> str | None:
    return first(
        method_problem(TCPServer, "run", ("self",), ("_read_data", "stream")),
        method_problem(TCPServer, "protocol_send", ("self", "event"), ("Updated", "idle")),
        attributes_problem(TCPServer, ("stream", "config")),
    )


def fix_4_patches() -> tuple[Patch, ...]:
    """A connection table. With `connection_table` on the config (connections.py), a
    connection from a peer over its limit is closed at once, and one beyond the node's limit
    takes the place of a connection doing nothing, or is closed at once if all are busy; so
    descriptors stay well below the process's limit and accept(2) never meets EMFILE."""

    def make_run(original: Any) -> Any:
        async def run(self: Any) -> None:
            table: ConnectionTable | None = getattr(self.config, "connection_table", None)
            if table is None:
                await original(self)
                return
            admission = table.enter(_peer_of(self.stream), self)
            if admission.victim is not None:
                # Make room: close a connection that is doing nothing (connections.py).
                await _close_transport(admission.victim.handle.stream)
            if admission.entry is None:
                # Closed before anything is read: the client sees a reset, tries another node.
                await trio.aclose_forcefully(self.stream)
                return
            self._neuron_conn = admission.entry
            try:
                await original(self)
            except (trio.ClosedResourceError, trio.BrokenResourceError, OSError):
                if not admission.entry.gone:
                    raise
                # Evicted mid-handshake or mid-read: closing its socket is how it ends.
            finally:
                table.leave(admission.entry)

        return run

    def make_send(original: Any) -> Any:
        async def protocol_send(self: Any, event: Any) -> None:
            if isinstance(event, Updated):
                table: ConnectionTable | None = getattr(self.config, "connection_table", None)
                entry: ConnectionEntry | None = self.__dict__.get("_neuron_conn")
                if table is not None and entry is not None:
                    if event.idle:
                        table.idle(entry)
                    else:
                        table.busy(entry)
            await original(self, event)

        return protocol_send

    return (Patch(TCPServer, "run", make_run), Patch(TCPServer, "protocol_send", make_send))


# --- fix 5 --------------------------------------------------------------------------------------


def fix_5_shape() -> str | None:
    return first(
        method_problem(TCPServer, "_read_data", ("self",), ("receive_some",)),
        method_problem(TCPServer, "_idle_timeout", ("self",), ("keep_alive_timeout",)),
        attributes_problem(TCPServer, ("idle_task",)),
        method_problem(TrioSingleTask, "stop", ("self",)),
    )


def fix_5_patches() -> tuple[Patch, ...]:
    """A connection the client closed is closed at once. On EOF hypercorn closes the streams,
    which restarts the connection's idle timer, and the connection's task group then waits for
    that timer: the socket stayed open for `keep_alive_timeout` (75 s here) after the peer had
    gone, so a client that reconnects often held dozens of dead descriptors. Once the read
    loop has ended the timer is stopped and not restarted (the app tasks' last
    `Updated(idle=True)` arrives after it, in an order trio does not fix)."""

    def make_read(original: Any) -> Any:
        async def _read_data(self: Any) -> None:
            await original(self)
            # The peer is gone: do not wait keep_alive_timeout to close. A timer (re)started
            # from now on returns at once; the one running now is cancelled.
            self._neuron_peer_gone = True
            idle = getattr(self, "idle_task", None)
            if idle is not None:
                await idle.stop()

        return _read_data

    def make_idle(original: Any) -> Any:
        async def _idle_timeout(self: Any) -> None:
            if getattr(self, "_neuron_peer_gone", False):
                return
            await original(self)

        return _idle_timeout

    return (
        Patch(TCPServer, "_read_data", make_read),
        Patch(TCPServer, "_idle_timeout", make_idle),
    )


# --- fix 8 --------------------------------------------------------------------------------------


def fix_8_shape() -> str | None:
    return first(
        method_problem(H11Protocol, "handle", ("self", "event"), ("RawData", "receive_data")),
        method_problem(H11Protocol, "_send_error_response", ("self", "status_code")),
        None if "data" in getattr(RawData, "__dataclass_fields__", {}) else "RawData has no data",
    )


def fix_8_patches() -> tuple[Patch, ...]:
    """No error answer to a peer that has gone. An HTTP/1.1 request cut off by the client's
    close made hypercorn write a 400 to the closed socket (h11 reports the cut as a protocol
    error): 4,096 one-byte connections closed at once cost the event loop ~1 s that way, and
    /health waited behind it. A request cut off by EOF now just ends its connection."""

    def make_handle(original: Any) -> Any:
        async def handle(self: Any, event: Any) -> None:
            if isinstance(event, RawData) and not event.data:
                # hypercorn's RawData(b"") is the peer's EOF. Fix 5's flag is set on the server
                # only after the read loop, too late: the 400 is written while handling this.
                self._neuron_peer_closed = True
            await original(self, event)

        return handle

    def make_error(original: Any) -> Any:
        async def _send_error_response(self: Any, status_code: int) -> None:
            if getattr(self, "_neuron_peer_closed", False):
                return  # a request the peer's close cut off: nobody reads the answer
            await original(self, status_code)

        return _send_error_response

    return (
        Patch(H11Protocol, "handle", make_handle),
        Patch(H11Protocol, "_send_error_response", make_error),
    )
