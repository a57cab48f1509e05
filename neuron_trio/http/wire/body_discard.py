"""A request body its response did not read (a 401, 404, 413, 503, …) over HTTP/2: the one
policy, in two phases, and its bounds.

1. Before the response's last frame (middleware.py): read and drop at most BEFORE_END_BYTES
   more of it, for at most BEFORE_END_TIMEOUT_S. hypercorn queues a stream's DATA for the
   app (`max_app_queue_size` messages) until the stream closes; a response that left them
   unread would, once that queue is full, block the connection's reader and the stream's own
   close. Past either bound the response goes out anyway.
2. After the response has ended (_hypercorn_fixes.py, fix 2): DATA for the stream is
   acknowledged and dropped, at most AFTER_END_BYTES a stream (clients such as httpx and curl
   send the whole body before they read the answer); past that the stream is reset with
   NO_ERROR, as RFC 9113 §8.1 allows after a complete response. So a client cannot hold a
   stream open by trickling a body, nor stop the server by sending one.

Read through the module (`body_discard.AFTER_END_BYTES`) so that tests can lower them.
"""

from __future__ import annotations

BEFORE_END_BYTES = 1 << 20
BEFORE_END_TIMEOUT_S = 2.0
AFTER_END_BYTES = 16 << 20
