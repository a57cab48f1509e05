"""One targeted fix to hypercorn 0.18's HTTP/2 protocol, applied by `serve_http`.

The race: a response's END_STREAM flag is sent by the connection's send task, after it has
emptied the stream's buffer; the stream's close (`StreamClosed`) is handled in the app's task
as soon as the buffer is empty. During a shutdown the close of the last stream sends GOAWAY
and tears the connection down at once, so the send task never sends END_STREAM: a response
that finished during a drain arrives whole but never ended, and a strict HTTP/2 client
reports it as failed. The fix sends END_STREAM (if still due) before the close is handled;
the send task's own later END_STREAM then finds the stream closed, a case it already handles.

Applied only if hypercorn's H2Protocol still has the shape this was written against;
otherwise it logs and leaves hypercorn alone. (The other hypercorn trap, DATA frames for an
ended stream, is avoided at the ASGI level: see middleware.py.)
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_APPLIED = False


def apply_hypercorn_fixes() -> None:
    """Install the END_STREAM-before-close fix once; idempotent."""
    global _APPLIED
    if _APPLIED:
        return
    try:
        import h2.exceptions
        from hypercorn.protocol.events import StreamClosed
        from hypercorn.protocol.h2 import H2Protocol, StreamBuffer
    except ImportError:  # pragma: no cover - a hypercorn without these modules
        log.warning("hypercorn's HTTP/2 protocol has moved; END_STREAM fix not applied")
        return
    original = getattr(H2Protocol, "stream_send", None)
    if (
        original is None
        or not hasattr(StreamBuffer, "complete")
        or not hasattr(H2Protocol, "_flush")
    ):
        log.warning("hypercorn's HTTP/2 protocol has changed; END_STREAM fix not applied")
        return

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

    H2Protocol.stream_send = stream_send  # type: ignore[method-assign]
    _APPLIED = True
