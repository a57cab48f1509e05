"""hypercorn fixes 1, 2, 6 and 7: the HTTP/2 protocol's stream ends and writes (what each
repairs: its `fix_N_patches` docstring; the table: _hypercorn_fixes.py)."""

from __future__ import annotations

from typing import Any

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.stream
import priority
from hypercorn.protocol.events import Response, StreamClosed
from hypercorn.protocol.h2 import H2Protocol, StreamBuffer

from neuron_trio.http.wire import body_discard
from neuron_trio.http.wire._hypercorn_shape import (
    Patch,
    attributes_problem,
    first,
    has,
    is_property,
    method_problem,
)
from neuron_trio.http.wire.h2_floods import ControlFrame

# Fix 6: pending frames are written once they reach this size, even if more could be framed.
FLUSH_BYTES = 1 << 16
# Fix 7: free WINDOW_UPDATEs a connection may have earned by the DATA frames it was sent.
WINDOW_UPDATE_CREDIT_MAX = 10_000


# --- fix 1 --------------------------------------------------------------------------------------


def fix_1_shape() -> str | None:
    return first(
        method_problem(H2Protocol, "stream_send", ("self", "event"), ("StreamClosed",)),
        method_problem(H2Protocol, "_flush", ("self",)),
        attributes_problem(H2Protocol, ("connection", "stream_buffers", "closed")),
        is_property(StreamBuffer, "complete"),
        has(h2.connection.H2Connection, "end_stream"),
    )


def fix_1_patches() -> tuple[Patch, ...]:
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


def fix_2_shape() -> str | None:
    return first(
        method_problem(H2Protocol, "stream_send", ("self", "event"), ("Response", "StreamClosed")),
        method_problem(
            H2Protocol, "_handle_events", ("self", "events"), ("DataReceived", "streams")
        ),
        attributes_problem(H2Protocol, ("connection", "streams", "stream_buffers", "config")),
        attributes_problem(h2.stream.H2Stream, ("_expected_content_length",)),
        has(h2.connection.H2Connection, "acknowledge_received_data", "reset_stream"),
        has(h2.events, "DataReceived", "StreamEnded", "StreamReset"),
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


def fix_2_patches() -> tuple[Patch, ...]:
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


# --- fix 6 --------------------------------------------------------------------------------------


def fix_6_shape() -> str | None:
    # The send task is replaced whole and `_send_data` mimicked: both must still do what the
    # copy does, with the names it calls.
    return first(
        method_problem(
            H2Protocol, "send_task", ("self",), ("priority", "DeadlockError", "has_data")
        ),
        method_problem(
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
        method_problem(H2Protocol, "_flush", ("self",)),
        attributes_problem(
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


def fix_6_patches() -> tuple[Patch, ...]:
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


def fix_7_shape() -> str | None:
    # It refines fix 3's budget with fix 6's frames (its `requires`: both are checked, and
    # installed, before it).
    return has(h2.events, "WindowUpdated")


def fix_7_patches() -> tuple[Patch, ...]:
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
