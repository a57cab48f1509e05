"""Targeted fixes to hypercorn 0.18's trio server and HTTP/2 protocol, applied by `serve_http`.

Each fix is its own `Fix` (the table `FIXES` at the end): a number and title, a shape check
(does hypercorn still have the methods, parameters and names the fix was written against?)
and the patches it installs, each built from the method it replaces. What a fix repairs is
its `_fix_N` function's docstring. `apply_hypercorn_fixes` checks every shape before it
installs anything; if one does not match, it raises `HypercornFixError` (a `ConfigError`:
the daemon refuses to serve with exit 78, naming the version and the fix), so a node never
serves without its HTTP/2 hardening. pyproject.toml pins hypercorn to the minor the fixes
were verified against.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from types import CodeType
from typing import Any, cast

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.stream
import priority
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Response, StreamClosed
from hypercorn.protocol.h2 import H2Protocol, StreamBuffer
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

from neuron_trio.errors import ConfigError
from neuron_trio.http import body_discard
from neuron_trio.http.connections import ConnectionEntry, ConnectionTable
from neuron_trio.http.h2_floods import ControlFrame, FloodGuard, FloodVerdict, NodeFloodBudget

__all__ = ["FIXES", "Fix", "HypercornFixError", "apply_hypercorn_fixes", "hypercorn_version"]

log = logging.getLogger(__name__)

_APPLIED = False

# Fix 6: pending frames are written once they reach this size, even if more could be framed.
FLUSH_BYTES = 1 << 16
# Fix 7: free WINDOW_UPDATEs a connection may have earned by the DATA frames it was sent.
WINDOW_UPDATE_CREDIT_MAX = 10_000


class HypercornFixError(ConfigError):
    """Raised by `apply_hypercorn_fixes` if a fix's shape check fails on the installed
    hypercorn: the daemon exits 78 rather than serve without that fix."""


def hypercorn_version() -> str:
    try:
        return metadata.version("hypercorn")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "(unknown version)"


# --- shape checks -----------------------------------------------------------------------------


def _names(code: CodeType) -> set[str]:
    """Every global and attribute name `code` refers to, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def _method_problem(
    cls: type, name: str, params: tuple[str, ...], uses: tuple[str, ...] = ()
) -> str | None:
    """What differs in `cls.name` from the coroutine method a fix expects, or None.

    `uses`: names hypercorn's own code refers to that the fix relies on (or mimics). A method
    already patched is checked through its `__wrapped__` chain, i.e. hypercorn's own."""
    method = getattr(cls, name, None)
    if method is None:
        return f"{cls.__name__}.{name} is gone"
    method = inspect.unwrap(method)
    if not inspect.iscoroutinefunction(method):
        return f"{cls.__name__}.{name} is no longer a coroutine function"
    found = tuple(inspect.signature(method).parameters)
    if found != params:
        return f"{cls.__name__}.{name} takes {found}, not {params}"
    missing = sorted(set(uses) - _names(method.__code__))
    if missing:
        return f"{cls.__name__}.{name} no longer uses {', '.join(missing)}"
    return None


def _attributes_problem(cls: type, attributes: tuple[str, ...]) -> str | None:
    """Instance attributes a fix reads that `cls.__init__` no longer sets, or None."""
    missing = sorted(set(attributes) - _names(inspect.unwrap(cast(Any, cls).__init__).__code__))
    if missing:
        return f"{cls.__name__}.__init__ no longer sets {', '.join(missing)}"
    return None


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


# --- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Patch:
    """`cls.name` replaced by `make(the method it replaces)`."""

    cls: type
    name: str
    make: Callable[[Any], Any]


@dataclass(frozen=True)
class Fix:
    number: int
    title: str
    shape: Callable[[], str | None]  # None: hypercorn has the shape this fix was written for
    patches: Callable[[], tuple[Patch, ...]]

    def install(self) -> None:
        for patch in self.patches():
            original = getattr(patch.cls, patch.name, None)
            replacement = patch.make(original)
            if original is not None:
                functools.update_wrapper(replacement, original)  # __wrapped__: the shape check
            setattr(patch.cls, patch.name, replacement)


def shape_problems() -> Iterator[tuple[Fix, str]]:
    """Each fix whose shape check fails on the installed hypercorn, with what differs."""
    for fix in FIXES:
        problem = fix.shape()
        if problem is not None:
            yield fix, problem


def apply_hypercorn_fixes() -> None:
    """Install every fix once (idempotent); raise HypercornFixError, installing nothing, if
    any fix's shape check fails."""
    global _APPLIED
    if _APPLIED:
        return
    for fix, problem in shape_problems():
        raise HypercornFixError(
            f"hypercorn {hypercorn_version()}: fix {fix.number} ({fix.title}) does not apply: "
            f"{problem}; neuron's HTTP/2 fixes are written for hypercorn 0.18, "
            "refusing to serve without them"
        )
    for fix in FIXES:
        fix.install()
    _APPLIED = True


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


def _is_property(cls: type, name: str) -> str | None:
    if isinstance(inspect.getattr_static(cls, name, None), property):
        return None
    return f"{cls.__name__}.{name} is no longer a property"


def _has(owner: Any, *names: str) -> str | None:
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        return f"{getattr(owner, '__name__', owner)} has no {', '.join(missing)}"
    return None


# --- fix 1 --------------------------------------------------------------------------------------


def _fix_1_shape() -> str | None:
    return _first(
        _method_problem(H2Protocol, "stream_send", ("self", "event"), ("StreamClosed",)),
        _method_problem(H2Protocol, "_flush", ("self",)),
        _attributes_problem(H2Protocol, ("connection", "stream_buffers", "closed")),
        _is_property(StreamBuffer, "complete"),
        _has(h2.connection.H2Connection, "end_stream"),
    )


def _fix_1_patches() -> tuple[Patch, ...]:
    """END_STREAM before close. A response's END_STREAM flag is sent by the connection's send
    task, after it has emptied the stream's buffer; the stream's close (`StreamClosed`) is
    handled in the app's task as soon as the buffer is empty. During a shutdown the close of
    the last stream sends GOAWAY and tears the connection down at once, so the send task never
    sends END_STREAM: a response that finished during a drain arrives whole but never ended,
    and a strict HTTP/2 client reports it as failed. The fix sends END_STREAM (if still due)
    before the close is handled; the send task's own later END_STREAM then finds the stream
    closed, a case it already handles."""

    def make(original: Any) -> Any:
        async def stream_send(self: Any, event: Any) -> None:
            if isinstance(event, StreamClosed) and not self.closed:
                buffer = self.stream_buffers.get(event.stream_id)
                if buffer is not None and buffer.complete:
                    try:
                        self.connection.end_stream(event.stream_id)
                        await self._flush()
                    except h2.exceptions.ProtocolError:
                        pass  # already ended, reset, or the connection is closing
            await original(self, event)

        return stream_send

    return (Patch(H2Protocol, "stream_send", make),)


# --- fix 2 --------------------------------------------------------------------------------------


def _fix_2_shape() -> str | None:
    return _first(
        _method_problem(H2Protocol, "stream_send", ("self", "event"), ("Response", "StreamClosed")),
        _method_problem(
            H2Protocol, "_handle_events", ("self", "events"), ("DataReceived", "streams")
        ),
        _attributes_problem(H2Protocol, ("connection", "streams", "stream_buffers", "config")),
        _attributes_problem(h2.stream.H2Stream, ("_expected_content_length",)),
        _has(h2.connection.H2Connection, "acknowledge_received_data", "reset_stream"),
        _has(h2.events, "DataReceived", "StreamEnded", "StreamReset"),
    )


def _forget_content_length(self: Any, stream_id: int) -> None:
    """An error response (or the end of any response) may come before the request body has:
    the rest of the body no longer matters, so h2 must not check it against the request's
    content-length. curl stops sending when it sees an early 413's headers and ends the stream
    short; h2 calls that a connection error (GOAWAY PROTOCOL_ERROR) and the client never read
    its 413 (issue 25, #11)."""
    stream = self.connection.streams.get(stream_id)
    if stream is not None and hasattr(stream, "_expected_content_length"):
        stream._expected_content_length = None


def _drop_data(self: Any, event: Any) -> None:
    """DATA for a stream whose response has ended: acknowledge and drop it while the stream
    has dropped at most `body_discard.AFTER_END_BYTES`; past that, once the response's
    END_STREAM has gone out, reset the stream with NO_ERROR."""
    try:
        self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
    except h2.exceptions.ProtocolError:
        pass
    dropped: dict[int, int] = self.__dict__.setdefault("_neuron_dropped", {})
    total = dropped.get(event.stream_id, 0) + event.flow_controlled_length
    if total <= body_discard.AFTER_END_BYTES or event.stream_id in self.stream_buffers:
        # Within the budget, or the response is still being sent (a reset now would cut it):
        # keep reading, so a client that sends its whole body first (httpx, curl) then reads
        # the answer whole.
        dropped[event.stream_id] = total
        return
    dropped.pop(event.stream_id, None)
    try:
        self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
    except h2.exceptions.ProtocolError:
        pass  # already reset or closed on both sides: nothing more to say


def _fix_2_patches() -> tuple[Patch, ...]:
    """DATA for an ended stream. hypercorn looks the stream up with `self.streams[id]` and the
    KeyError escapes the connection's handler nursery, which is the server's: one client that
    keeps sending a body after a 401 or 413 stopped every connection. Such DATA is now
    acknowledged (so the connection's flow-control window does not shrink) and dropped, up to
    `body_discard.AFTER_END_BYTES` a stream (the policy's second phase: body_discard.py);
    past that, once the response has ended, the stream is reset with NO_ERROR. An error
    response also lifts
    h2's content-length check on the rest of the body (a client that stops early ended the
    stream short, and h2 closed the whole connection with PROTOCOL_ERROR)."""

    def make_send(original: Any) -> Any:
        async def stream_send(self: Any, event: Any) -> None:
            if isinstance(event, StreamClosed) or (
                isinstance(event, Response) and event.status_code >= 400
            ):
                _forget_content_length(self, event.stream_id)
            await original(self, event)

        return stream_send

    def make_events(original: Any) -> Any:
        async def _handle_events(self: Any, events: list[Any]) -> None:
            pending: list[Any] = []
            for event in events:
                if isinstance(event, h2.events.DataReceived):
                    if pending:  # a stream may be created by an event before this one
                        await original(self, pending)
                        pending = []
                    if event.stream_id not in self.streams:
                        _drop_data(self, event)
                        continue
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    self.__dict__.get("_neuron_dropped", {}).pop(event.stream_id, None)
                pending.append(event)
            await original(self, pending)  # even if empty: it flushes the acknowledgements

        return _handle_events

    return (
        Patch(H2Protocol, "stream_send", make_send),
        Patch(H2Protocol, "_handle_events", make_events),
    )


# --- fix 3 --------------------------------------------------------------------------------------


def _fix_3_shape() -> str | None:
    return _first(
        _method_problem(H2Protocol, "_handle_events", ("self", "events"), ("StreamReset",)),
        _method_problem(H2Protocol, "_flush", ("self",)),
        _attributes_problem(
            H2Protocol, ("connection", "stream_buffers", "priority", "client", "config", "send")
        ),
        _has(priority.PriorityTree, "remove_stream"),
        _has(priority, "MissingStreamError"),
        _has(h2.connection.H2Connection, "close_connection"),
        _has(
            h2.events,
            "PingReceived",
            "PingAckReceived",
            "RemoteSettingsChanged",
            "SettingsAcknowledged",
            "PriorityUpdated",
            "UnknownFrameReceived",
            "WindowUpdated",
        ),
    )


def _control_frame(self: Any, event: Any) -> ControlFrame | None:
    """What `event` costs against the flood budgets (h2_floods.py), if anything. Installed as
    `H2Protocol._neuron_control_frame` (fix 7 wraps it)."""
    if isinstance(event, h2.events.StreamReset):
        return ControlFrame.RESET if event.remote_reset else None
    if isinstance(event, h2.events.PingReceived | h2.events.PingAckReceived):
        return ControlFrame.PING
    if isinstance(event, h2.events.RemoteSettingsChanged | h2.events.SettingsAcknowledged):
        return ControlFrame.SETTINGS
    if isinstance(event, h2.events.PriorityUpdated):
        return ControlFrame.PRIORITY
    if isinstance(event, h2.events.UnknownFrameReceived):
        return ControlFrame.UNKNOWN
    if isinstance(event, h2.events.DataReceived):
        empty = not event.flow_controlled_length and event.stream_ended is None
        return ControlFrame.EMPTY_DATA if empty else None
    if isinstance(event, h2.events.WindowUpdated):
        return ControlFrame.WINDOW_UPDATE
    return None


def _flood_guard(self: Any) -> FloodGuard | None:
    guard: FloodGuard | None = self.__dict__.get("_neuron_flood")
    if guard is None:
        node: NodeFloodBudget | None = getattr(self.config, "h2_flood_budget", None)
        if node is None:
            return None
        guard = FloodGuard(
            node,
            rate=float(getattr(self.config, "h2_control_rate_per_s", 50.0)),
            burst=float(getattr(self.config, "h2_control_burst", 200.0)),
            reset_rate=float(getattr(self.config, "h2_reset_rate_per_s", 100.0)),
            reset_burst=float(getattr(self.config, "h2_reset_burst", 1000.0)),
            grace=float(getattr(self.config, "h2_flood_grace", 50.0)),
        )
        self._neuron_flood = guard
    return guard


def _forget_reset_stream(self: Any, stream_id: int) -> None:
    """A stream the client reset: drop its send buffer and priority entry now. hypercorn drops
    them only once a response's data has gone out, so a stream reset before any response
    stayed for the connection's life, and the 1,001st made the priority tree raise
    TooManyStreamsError, which stopped the whole server (issue 25, found by
    bench/attack_drill.py). A late send from the app finds no buffer (hypercorn ignores
    that)."""
    buffer = self.stream_buffers.pop(stream_id, None)
    if buffer is not None:
        with contextlib.suppress(priority.MissingStreamError):
            self.priority.remove_stream(stream_id)


async def _close_flooded(self: Any, kind: ControlFrame, verdict: FloodVerdict, guard: Any) -> None:
    log.warning(
        "closing an HTTP/2 connection from %s: %s frames faster than %s allows (%s)",
        self.client[0] if self.client else "?",
        kind.value,
        "its budget" if verdict is FloodVerdict.CONNECTION_OVER_BUDGET else "the node's budget",
        ", ".join(f"{k.value} {n}" for k, n in guard.counts.items()),
    )
    self.connection.close_connection(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
    await self._flush()
    await self.send(Closed())


def _fix_3_guarded(original: Any) -> Any:
    async def guarded(self: Any, events: list[Any]) -> None:
        pending: list[Any] = []
        guard = _flood_guard(self)
        for event in events:
            if isinstance(event, h2.events.StreamReset) and pending:
                # events before the reset first: hypercorn handles the reset on its own below
                await original(self, pending)
                pending = []
            kind = self._neuron_control_frame(event) if guard is not None else None
            if kind is not None and guard is not None:
                verdict = guard.spend(kind, trio.current_time())
                if verdict is not FloodVerdict.OK:
                    if pending:
                        await original(self, pending)
                    await _close_flooded(self, kind, verdict, guard)
                    return
            if isinstance(event, h2.events.StreamReset):
                await original(self, [event])
                _forget_reset_stream(self, event.stream_id)
                continue
            pending.append(event)
        await original(self, pending)

    return guarded


def _fix_3_patches() -> tuple[Patch, ...]:
    """Floods as rates. hypercorn's defence against rapid reset (CVE-2023-44487) is
    `keep_alive_max_requests`: GOAWAY and a closed socket after N requests on a connection,
    streams in flight included, which a router holding one connection for days cannot live
    with. `hypercorn_config` turns that count off; instead resets and control frames spend
    tokens from the connection's budgets and the node's (h2_floods.py); a connection over
    budget gets GOAWAY ENHANCE_YOUR_CALM and is closed. Honest clients never come near it. A
    stream reset before its response leaves no send buffer or priority entry behind (the
    1,001st such stream made the priority tree raise and stopped the server), and any other
    error raised by a peer's frames ends that connection only."""

    def make(original: Any) -> Any:
        guarded = _fix_3_guarded(original)

        async def _handle_events(self: Any, events: list[Any]) -> None:
            try:
                await guarded(self, events)
            except Exception:
                # Whatever a peer's frames make hypercorn or h2 raise ends that connection,
                # never the server (an exception here escapes into the listener's nursery).
                log.exception(
                    "closing an HTTP/2 connection from %s after an unexpected error",
                    self.client[0] if self.client else "?",
                )
                with contextlib.suppress(Exception):
                    self.connection.close_connection(h2.errors.ErrorCodes.INTERNAL_ERROR)
                    await self._flush()
                await self.send(Closed())

        return _handle_events

    return (
        Patch(H2Protocol, "_handle_events", make),
        Patch(H2Protocol, "_neuron_control_frame", lambda _none: _control_frame),
    )


# --- fix 4 --------------------------------------------------------------------------------------


def _fix_4_shape() -> str | None:
    return _first(
        _method_problem(TCPServer, "run", ("self",), ("_read_data", "stream")),
        _method_problem(TCPServer, "protocol_send", ("self", "event"), ("Updated", "idle")),
        _attributes_problem(TCPServer, ("stream", "config")),
    )


def _fix_4_patches() -> tuple[Patch, ...]:
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


def _fix_5_shape() -> str | None:
    return _first(
        _method_problem(TCPServer, "_read_data", ("self",), ("receive_some",)),
        _method_problem(TCPServer, "_idle_timeout", ("self",), ("keep_alive_timeout",)),
        _attributes_problem(TCPServer, ("idle_task",)),
        _method_problem(TrioSingleTask, "stop", ("self",)),
    )


def _fix_5_patches() -> tuple[Patch, ...]:
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


# --- fix 6 --------------------------------------------------------------------------------------


def _fix_6_shape() -> str | None:
    # The send task is replaced whole and `_send_data` mimicked: both must still do what the
    # copy does, with the names it calls.
    return _first(
        _method_problem(
            H2Protocol, "send_task", ("self",), ("priority", "DeadlockError", "has_data")
        ),
        _method_problem(
            H2Protocol,
            "_send_data",
            ("self", "stream_id"),
            (
                "local_flow_control_window",
                "max_outbound_frame_size",
                "pop",
                "send_data",
                "block",
                "complete",
                "end_stream",
                "remove_stream",
                "close",
            ),
        ),
        _method_problem(H2Protocol, "_flush", ("self",)),
        _attributes_problem(
            H2Protocol, ("closed", "priority", "has_data", "stream_buffers", "connection")
        ),
    )


async def _frame_data(self: Any, stream_id: int) -> int:
    """hypercorn's `_send_data` without its flushes: frame one chunk of the stream's data (or
    its END_STREAM); return the bytes framed. Installed as `H2Protocol._neuron_frame_data`
    (fix 7 wraps it)."""
    try:
        chunk_size = min(
            self.connection.local_flow_control_window(stream_id),
            self.connection.max_outbound_frame_size,
        )
        data = await self.stream_buffers[stream_id].pop(max(0, chunk_size))
        if data:
            self.connection.send_data(stream_id, data)
        else:
            self.priority.block(stream_id)
        if self.stream_buffers[stream_id].complete:
            self.connection.end_stream(stream_id)
            del self.stream_buffers[stream_id]
            self.priority.remove_stream(stream_id)
        return len(data)
    except (h2.exceptions.StreamClosedError, KeyError, h2.exceptions.ProtocolError):
        # the stream or the connection closed while its data waited: drop it (as hypercorn)
        await self.stream_buffers[stream_id].close()
        del self.stream_buffers[stream_id]
        self.priority.remove_stream(stream_id)
        return 0


async def _send_task(self: Any) -> None:
    pending = 0
    while not self.closed:
        try:
            stream_id = next(self.priority)
        except priority.DeadlockError:  # no stream has data it may send: write, then wait
            await self._flush()
            pending = 0
            await self.has_data.wait()
            await self.has_data.clear()
        else:
            # No checkpoint in between: the buffers cannot grow meanwhile, so this ends.
            pending += await self._neuron_frame_data(stream_id)
            if pending >= FLUSH_BYTES:
                await self._flush()
                pending = 0


def _make_send_task(_original: Any) -> Any:
    # A function of its own per install: Fix.install marks it as wrapping hypercorn's.
    async def send_task(self: Any) -> None:
        await _send_task(self)

    return send_task


def _fix_6_patches() -> tuple[Patch, ...]:
    """One write for what the streams have ready. hypercorn's send task wrote each DATA frame
    to the socket on its own (a flush, a send_all and two trio checkpoints per chunk): a batch
    of 8 streams that each got a token made 8 writes, and the client 8 reads. The send task
    now frames every stream's pending data and writes once when no stream has more (or
    FLUSH_BYTES are pending): at 8 streams the event loop's CPU time per step fell by about a
    third. Flow control and the order of frames are hypercorn's own; only the writes merge."""
    return (
        Patch(H2Protocol, "_neuron_frame_data", lambda _none: _frame_data),
        Patch(H2Protocol, "send_task", _make_send_task),
    )


# --- fix 7 --------------------------------------------------------------------------------------


def _fix_7_shape() -> str | None:
    # It refines fix 3's budget with fix 6's frames: both must be in the table (and their
    # shapes are checked with theirs, before anything is installed).
    numbers = {fix.number for fix in FIXES}
    if not {3, 6} <= numbers:
        return "it needs fixes 3 and 6"
    return _has(h2.events, "WindowUpdated")


def _fix_7_patches() -> tuple[Patch, ...]:
    """WINDOW_UPDATEs earned. A client acknowledging the response data it read is not
    flooding: each DATA frame sent (fix 6's framing) earns two WINDOW_UPDATEs (the stream's
    and the connection's) that fix 3's budgets do not count, up to
    WINDOW_UPDATE_CREDIT_MAX."""

    def make_frame(original: Any) -> Any:
        async def frame_data(self: Any, stream_id: int) -> int:
            framed: int = await original(self, stream_id)
            if framed:
                credit = self.__dict__.get("_neuron_wu_credit", 0)
                self._neuron_wu_credit = min(WINDOW_UPDATE_CREDIT_MAX, credit + 2)
            return framed

        return frame_data

    def make_classify(original: Any) -> Any:
        def control_frame(self: Any, event: Any) -> ControlFrame | None:
            if isinstance(event, h2.events.WindowUpdated):
                credit = self.__dict__.get("_neuron_wu_credit", 0)
                if credit > 0:
                    self._neuron_wu_credit = credit - 1
                    return None
            result: ControlFrame | None = original(self, event)
            return result

        return control_frame

    return (
        Patch(H2Protocol, "_neuron_frame_data", make_frame),
        Patch(H2Protocol, "_neuron_control_frame", make_classify),
    )


# --- fix 8 --------------------------------------------------------------------------------------


def _fix_8_shape() -> str | None:
    return _first(
        _method_problem(H11Protocol, "handle", ("self", "event"), ("RawData", "receive_data")),
        _method_problem(H11Protocol, "_send_error_response", ("self", "status_code")),
        None if "data" in getattr(RawData, "__dataclass_fields__", {}) else "RawData has no data",
    )


def _fix_8_patches() -> tuple[Patch, ...]:
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


# In the order they are installed: a later fix wraps what an earlier one installed (fix 3's
# event handler wraps fix 2's; fix 7 wraps what fixes 3 and 6 add).
FIXES: tuple[Fix, ...] = (
    Fix(1, "END_STREAM before close", _fix_1_shape, _fix_1_patches),
    Fix(2, "DATA for an ended stream", _fix_2_shape, _fix_2_patches),
    Fix(3, "floods as rates", _fix_3_shape, _fix_3_patches),
    Fix(4, "a connection table", _fix_4_shape, _fix_4_patches),
    Fix(5, "a connection the client closed is closed at once", _fix_5_shape, _fix_5_patches),
    Fix(6, "one write for what the streams have ready", _fix_6_shape, _fix_6_patches),
    Fix(7, "WINDOW_UPDATEs earned", _fix_7_shape, _fix_7_patches),
    Fix(8, "no error answer to a peer that has gone", _fix_8_shape, _fix_8_patches),
)
