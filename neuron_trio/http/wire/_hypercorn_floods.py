"""hypercorn fix 3: floods of resets and control frames as rates (h2_floods.py's budgets),
and an error raised by a peer's frames ending its connection only."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.stream
import priority
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol.h2 import H2Protocol

from neuron_trio.http.wire._hypercorn_shape import (
    Patch,
    attributes_problem,
    first,
    has,
    method_problem,
)
from neuron_trio.http.wire.h2_floods import ControlFrame, FloodGuard, FloodVerdict, NodeFloodBudget

log = logging.getLogger(__name__)


# --- fix 3 --------------------------------------------------------------------------------------


# h2 parses a whole read (up to 64 KiB: ~2,500 rapid-reset streams of ~26 bytes) before the
# flood guard sees its first event, so a connection closed for its resets had had all of them
# parsed (HPACK in Python: 0.78 s of the node's CPU for one round of the tenancy drill's
# 10 x 1,000 resets). Fed in slices, the guard closes it at most ~80 streams after its budget
# runs out and the rest is never parsed. A DATA frame (up to 16 KiB) is buffered by h2 until
# its last slice, so an upload costs a few more calls, not more parsing.
PARSE_SLICE_BYTES = 2048


def fix_3_shape() -> str | None:
    return first(
        method_problem(H2Protocol, "_handle_events", ("self", "events"), ("StreamReset",)),
        method_problem(H2Protocol, "handle", ("self", "event"), ("RawData", "receive_data")),
        method_problem(H2Protocol, "_flush", ("self",)),
        attributes_problem(
            H2Protocol, ("connection", "stream_buffers", "priority", "client", "config", "send")
        ),
        has(priority.PriorityTree, "remove_stream"),
        has(priority, "MissingStreamError"),
        has(h2.connection.H2Connection, "close_connection"),
        has(
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


_STREAM_OPENING = (h2.events.RequestReceived, h2.events.DataReceived, h2.events.StreamEnded)


async def _skip_reset_stream(self: Any, event: Any) -> None:
    """An event of a stream the peer resets later in the same read: the stream is never made
    (no app task, no access line); its data still earns the connection's window back."""
    if isinstance(event, h2.events.DataReceived):
        self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)


def fix_3_guarded(original: Any) -> Any:
    async def guarded(self: Any, events: list[Any]) -> None:
        pending: list[Any] = []
        guard = _flood_guard(self)
        # Streams opened and reset in one read (a rapid-reset flood: HEADERS then RST_STREAM)
        # never reach the app: each cost a task, a request's start and cancellation and an
        # access line (~290 a round of the tenancy drill's resets, on the event loop).
        doomed = {e.stream_id for e in events if isinstance(e, h2.events.StreamReset)}
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
            if doomed and isinstance(event, _STREAM_OPENING) and event.stream_id in doomed:
                await _skip_reset_stream(self, event)  # counted above all the same
                continue
            if isinstance(event, h2.events.StreamReset):
                await original(self, [event])
                _forget_reset_stream(self, event.stream_id)
                continue
            pending.append(event)
        await original(self, pending)

    return guarded


def fix_3_sliced(original: Any) -> Any:
    """`H2Protocol.handle`: a read's bytes to h2 in slices of PARSE_SLICE_BYTES, none after
    the connection is closed (for a flood, or by h2 for a protocol error)."""

    async def handle(self: Any, event: Any) -> None:
        if not isinstance(event, RawData) or len(event.data) <= PARSE_SLICE_BYTES:
            await original(self, event)
            return
        data = memoryview(event.data)
        for start in range(0, len(data), PARSE_SLICE_BYTES):
            if self.closed or self.connection.state_machine.state is _H2_CLOSED:
                return
            await original(self, RawData(data=bytes(data[start : start + PARSE_SLICE_BYTES])))

    return handle


_H2_CLOSED = h2.connection.ConnectionState.CLOSED


def fix_3_patches() -> tuple[Patch, ...]:
    """Floods as rates. hypercorn's defence against rapid reset (CVE-2023-44487) is
    `keep_alive_max_requests`: GOAWAY and a closed socket after N requests on a connection,
    streams in flight included, which a router holding one connection for days cannot live
    with. `hypercorn_config` turns that count off; instead resets and control frames spend
    tokens from the connection's budgets and the node's (h2_floods.py); a connection over
    budget gets GOAWAY ENHANCE_YOUR_CALM and is closed. Honest clients never come near it. A
    stream reset before its response leaves no send buffer or priority entry behind (the
    1,001st such stream made the priority tree raise and stopped the server), and any other
    error raised by a peer's frames ends that connection only. A read is parsed a slice at a
    time (PARSE_SLICE_BYTES), so the frames behind a flood's last allowed one are never
    parsed."""

    def make(original: Any) -> Any:
        guarded = fix_3_guarded(original)

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
        Patch(H2Protocol, "handle", fix_3_sliced),
        Patch(H2Protocol, "_neuron_control_frame", lambda _none: _control_frame),
    )
