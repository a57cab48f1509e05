"""Fixtures shared by the service tests' folders."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from .hub_server import GGUF_BYTES, HubHandler


@pytest.fixture
def hub() -> Iterator[str]:
    HubHandler.files = {"acme/tiny/tiny.Q4_0.gguf": GGUF_BYTES}
    HubHandler.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
