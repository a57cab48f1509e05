"""The root nursery: signals → notifier → gpus → node (default models) → http.

`run(config) -> exit code`. The order matters:

1. the signal receiver opens first (a SIGTERM before it would kill the process outright);
2. the notifier (WATCHDOG=1 pings start), the identity (start counter), the GPU actor;
3. the node loads the default models (STATUS= lines show progress); a failure is exit 69;
4. the HTTP server binds; then failpoints are armed, the node is marked serving (`/health`
   200) and READY=1 goes to systemd.

The first SIGTERM/SIGINT drains: health says draining (new requests 503), STOPPING=1,
in-flight requests finish (at most `server.drain_timeout_s`), the listener closes, every
model is unloaded, exit 0. A signal during start-up stops the start-up the same way.
A second signal stops at once (`service.process.signals`). The deadman exits 70 by itself.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import trio
from prometheus_client import CollectorRegistry

from neuron_trio import failpoints
from neuron_trio.config import NeuronConfig
from neuron_trio.errors import (
    EX_CONFIG,
    EX_OK,
    EX_OSERR,
    EX_UNAVAILABLE,
    ConfigError,
    ModelLoadError,
)
from neuron_trio.gpu.actor import GpuActor
from neuron_trio.gpu.metrics import GpuCollector
from neuron_trio.gpu.nvml import GpuProbe
from neuron_trio.service.process.identity import Identity
from neuron_trio.service.process.notifier import Notifier
from neuron_trio.service.process.signals import SignalWatcher, die_by_signal, flush_logs

log = logging.getLogger(__name__)

EX_CRASH = 1  # an unexpected exception: a bug, logged with its traceback
# After the in-flight wait: hypercorn closing its connections, then unloading the models.
# Both are bounded so that a drain ends before systemd's TimeoutStopSec (120 s) kills it.
HTTP_CLOSE_TIMEOUT_S = 5.0
UNLOAD_TIMEOUT_S = 10.0


class DaemonNode(Protocol):
    """What the daemon asks of `service.node.Node` (beyond the HTTP layer's NodeService)."""

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """Where `/metrics` reads from; the daemon adds the GPU collector to it."""

    async def run(self, *, task_status: Any = ...) -> None:
        """Load `config.default_models` (progress as STATUS= lines through the notifier),
        report started once they are loaded, then host the model actors until `unload_all`
        (or cancellation). Raises ModelLoadError if a default model cannot be loaded."""

    def mark_serving(self) -> None:
        """Health `starting` → `ok`."""

    def begin_drain(self) -> None:
        """Health → `draining`; new inference requests get 503 with Retry-After."""

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait at most `timeout` s until no request is queued or running; True if so."""

    async def unload_all(self) -> None:
        """Unload every model (free the GPUs) before exit."""


NodeFactory = Callable[..., DaemonNode]
ServeHttp = Callable[..., Awaitable[None]]


def _default_node_factory(
    config: NeuronConfig, *, identity: Identity, gpus: GpuActor, notifier: Notifier
) -> DaemonNode:
    from neuron_trio.service import heap
    from neuron_trio.service.model_start import use_header_store
    from neuron_trio.service.node import Node

    heap.freeze_imports()  # the last heavy import (torch) is done: service/heap.py
    use_header_store(config)  # before the node reads its first header
    node: DaemonNode = Node(
        config, identity=identity, gpus=gpus, notifier=notifier, settle_heap=True
    )
    return node


def _default_create_app(node: Any, config: NeuronConfig) -> Any:
    from neuron_trio.http.app import create_app

    return create_app(node, config)


def _default_serve_http() -> ServeHttp:
    from neuron_trio.http.server import serve_http

    return serve_http


@dataclass
class Wiring:
    """The parts `serve` builds; tests replace them with doubles from tests/."""

    make_node: NodeFactory = _default_node_factory
    create_app: Callable[[Any, NeuronConfig], Any] = _default_create_app
    serve_http: ServeHttp | None = None  # None: http.server.serve_http
    gpu_probe: GpuProbe | None = None  # None: NVML
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    on_second_signal: Callable[[int], object] = die_by_signal


class Daemon:
    """One run of the daemon. `phase`: starting → serving → draining → stopped."""

    def __init__(self, config: NeuronConfig, wiring: Wiring | None = None) -> None:
        self.config = config
        self.wiring = wiring or Wiring()
        self.phase = "starting"
        self.notifier = Notifier(self.wiring.environ)
        self.drain_requested = trio.Event()
        self.http_shutdown = trio.Event()
        self.http_done = trio.Event()
        self._http_running = False
        self.node: DaemonNode | None = None
        self.identity: Identity | None = None
        self._startup_scope: trio.CancelScope | None = None

    def begin_drain(self, signum: int) -> None:
        """The first SIGTERM/SIGINT (called by the signal watcher)."""
        self.drain_requested.set()
        if self.phase == "starting" and self._startup_scope is not None:
            log.warning("signal during start-up: stopping the start-up")
            self._startup_scope.cancel()

    async def main(self) -> int:
        started = time.monotonic()
        async with trio.open_nursery() as root:
            signals = SignalWatcher(self.begin_drain, on_second=self.wiring.on_second_signal)
            await root.start(signals.run)  # first: before anything slow
            await root.start(self.notifier.run)
            with trio.CancelScope() as self._startup_scope:
                await self._start(root)
            if not (self._startup_scope.cancelled_caught or self.drain_requested.is_set()):
                self.phase = "serving"
                log.info("serving (start-up took %.1fs)", time.monotonic() - started)
                await self.drain_requested.wait()
            self.phase = "draining"
            await self._drain()
            root.cancel_scope.cancel()
        self.phase = "stopped"
        if self.identity is not None:
            self.identity.record_clean_stop()
        log.info("stopped")
        return EX_OK

    async def _start(self, root: trio.Nursery) -> None:
        config = self.config
        status = self.notifier.status
        identity = self.identity = Identity.create(config.state_path)
        log.info(
            "neuron starting: boot %s, start %d in %s, config %s",
            identity.boot_id,
            identity.starts,
            config.state_path,
            config.source_path,
        )
        status("discovering GPUs")
        gpus = GpuActor(self.wiring.gpu_probe)
        await root.start(gpus.run)
        status(
            "loading default models: "
            + (", ".join(m.name for m in config.default_models) or "none")
        )
        self.node = node = self.wiring.make_node(
            config, identity=identity, gpus=gpus, notifier=self.notifier
        )
        node.metrics_registry.register(GpuCollector(gpus))
        await root.start(node.run)
        app = self.wiring.create_app(node, config)
        serve_http = self.wiring.serve_http or _default_serve_http()
        status("binding " + ", ".join(config.server.listen))
        bound = await root.start(self._serve_http, partial(serve_http, app, config))
        listening = ", ".join(str(b) for b in bound) if bound else ", ".join(config.server.listen)
        # Armed just before /health first answers 200: loading and warm-up ran clean.
        failpoints.REGISTRY.arm()
        node.mark_serving()
        self.notifier.ready(f"serving on {listening}")

    async def _serve_http(
        self, serve: ServeHttp, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self._http_running = True
        try:
            await serve(shutdown_trigger=self.http_shutdown.wait, task_status=task_status)
        finally:
            self.http_done.set()

    async def _drain(self) -> None:
        timeout = self.config.server.drain_timeout_s
        self.notifier.stopping("draining")
        node = self.node
        if node is not None:
            node.begin_drain()
            if not await node.wait_idle(timeout):
                log.warning("drain: requests still in flight after %gs; closing anyway", timeout)
        self.http_shutdown.set()  # the listener closes; hypercorn finishes open responses
        if self._http_running:
            with trio.move_on_after(HTTP_CLOSE_TIMEOUT_S):
                await self.http_done.wait()
        if node is not None:
            self.notifier.status("unloading models")
            with trio.move_on_after(UNLOAD_TIMEOUT_S) as scope:
                await node.unload_all()
            if scope.cancelled_caught:
                log.warning("unloading models took over %gs; exiting anyway", UNLOAD_TIMEOUT_S)
        self.notifier.status("stopped")


def require_http_fixes() -> None:
    """Install hypercorn's fixes before anything starts (HypercornFixError, a ConfigError, if
    one does not fit the installed hypercorn: exit 78 then, rather than load models and serve
    without the HTTP/2 hardening)."""
    from neuron_trio.http.wire._hypercorn_fixes import apply_hypercorn_fixes

    apply_hypercorn_fixes()


def configure_failpoints(environ: Mapping[str, str]) -> None:
    """Parse NEURON_FAILPOINTS (ConfigError if malformed) and say so loudly when set."""
    spec = environ.get(failpoints.ENV_VAR, "")
    actions = failpoints.parse(spec)
    failpoints.REGISTRY.configure(actions)
    if actions:
        described = "; ".join(f"{name}={action}" for name, action in actions.items())
        log.warning("!" * 72)
        log.warning(
            "FAULT INJECTION ON: %s=%r (%s): this node WILL wedge on purpose; never in production",
            failpoints.ENV_VAR,
            spec,
            described,
        )
        log.warning("!" * 72)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def exit_code_for(exc: BaseException, listen: Sequence[str] = ()) -> int:
    """Map what ended the root nursery to an exit code (sysexits), logging it once."""
    leaves = _leaves(exc)
    for kind, code in ((ConfigError, EX_CONFIG), (ModelLoadError, EX_UNAVAILABLE)):
        found = [leaf for leaf in leaves if isinstance(leaf, kind)]
        if found:
            log.error("%s", found[0])
            return code
    bind = [leaf for leaf in leaves if isinstance(leaf, OSError)]
    if bind and all(isinstance(leaf, OSError | trio.Cancelled) for leaf in leaves):
        log.error("cannot listen on %s: %s", ", ".join(listen) or "server.listen", bind[0])
        return EX_OSERR
    log.critical("neuron crashed", exc_info=exc)
    return EX_CRASH


def run(config: NeuronConfig, wiring: Wiring | None = None) -> int:
    """Run the daemon until drained or failed; return the exit code."""
    wiring = wiring or Wiring()
    try:
        configure_failpoints(wiring.environ)
        if wiring.serve_http is None:
            require_http_fixes()
    except ConfigError as exc:
        log.error("%s", exc)
        return EX_CONFIG
    log.info("neuron %s on %s (pid %d)", _version(), socket.gethostname(), os.getpid())
    daemon = Daemon(config, wiring)
    try:
        return trio.run(daemon.main)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return exit_code_for(exc, config.server.listen)
    finally:
        flush_logs()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("neuron_trio")
    except Exception:
        return "(unknown version)"
