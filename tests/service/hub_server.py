"""A local stand-in for the model hub (HEAD/GET /{owner}/{repo}/resolve/{revision}/{file}) that
records each request; tests/service/conftest.py serves it as the `hub` fixture."""

from __future__ import annotations

import hashlib
import http.server
from typing import ClassVar

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# A small file that starts like a GGUF file; the hub path never parses it.
GGUF_BYTES = b"GGUF" + (3).to_bytes(4, "little") + bytes(range(256)) * 64


class HubHandler(http.server.BaseHTTPRequestHandler):
    """Stands in for the hub: HEAD/GET /{owner}/{repo}/resolve/{revision}/{file}."""

    files: ClassVar[dict[str, bytes]] = {}
    requests: ClassVar[list[tuple[str, str]]] = []

    def _answer(self, with_body: bool) -> None:
        type(self).requests.append((self.command, self.path))
        parts = self.path.split("?")[0].strip("/").split("/")
        body = None
        if len(parts) >= 5 and parts[2] == "resolve":
            body = self.files.get(f"{parts[0]}/{parts[1]}/{'/'.join(parts[4:])}")
        if body is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._answer(with_body=False)

    def do_GET(self) -> None:
        self._answer(with_body=True)

    def log_message(self, format: str, *args: object) -> None:
        pass
