"""The HTTP layer: an ASGI app over a `NodeService`, served by hypercorn's trio worker.

`create_app` (app.py) builds the app; `serve_http` (server.py) serves it. The app talks to
`neuron_trio.service.api.NodeService` only.
"""

from neuron_trio.http.app import create_app
from neuron_trio.http.server import BoundAddress, serve_http

__all__ = ["BoundAddress", "create_app", "serve_http"]
