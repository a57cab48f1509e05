"""The router drill: HAProxy in front of three real neuron daemons, and one fault at a time.

    python bench/router_drill.py [--json PATH] [--keep DIR] [--model GGUF] [--start-limit-burst 4]

Three `neuron serve` processes (the built-in model on the CPU, short watchdog deadlines) sit
behind HAProxy running `deploy/haproxy/neuron.cfg` (its bind, server and stats-socket lines
rewritten for the drill; every timing and retry setting as shipped), HTTP/2 on both sides.
A small supervisor plays systemd for each node: `Restart=on-failure`, a short `RestartSec`,
`StartLimitBurst` starts in `StartLimitIntervalSec=600`, no restart on exit 0 or 78. Two
clients (httpx, HTTP/2) send streamed and non-streamed chat completions through the proxy
without pause, and then, one at a time:

  (a) wedge     neuron1 enters rotation armed with `engine.step=hang`: its first step hangs,
                the watchdog fails its requests with 503, the deadman exits 70, the
                supervisor restarts it (clean);
  (b) drain     neuron2 gets SIGTERM (drains, exits 0) and is started again;
  (c) kill      neuron3 gets SIGKILL; the supervisor restarts it;
  (d) bad start neuron1 is restarted into a state that wedges on every start: the supervisor
                gives up after StartLimitBurst starts (`failed`), and the proxy must leave it
                out of rotation for good.

For each scenario it reports: when the fault began, seconds until HAProxy took the node out
of rotation, the client errors among requests started after the fault (the goal is 0), the
streams in flight on the node at the fault and how each ended, and seconds until the node was
back in rotation, and the slowest request after the fault (what the retries cost). Each time
a node armed to wedge enters rotation, the drill sends it a canary stream at once (leastconn
gives it to the idle node), so that a stream, not only a JSON request, meets every wedge; for
those scenarios the requests that count start when the node entered rotation. Wall-clock
instants come from one clock (time.time) shared with the daemons' log lines (the failpoint's
"fired" line marks a wedge's start).

The same code runs as the slow test tests/e2e/test_router_drill.py.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: tests.neuron_process lives in the repo
    sys.path.insert(0, str(REPO))

from tests.neuron_process import free_port, spawn_neuron  # noqa: E402

HAPROXY_CFG = REPO / "deploy" / "haproxy" / "neuron.cfg"
BACKEND = "neuron"
MODEL = "drill"
NODES = ("neuron1", "neuron2", "neuron3")
# Short deadlines so that a wedge costs seconds, not minutes (production: 30 s and 60 s).
STEP_TIMEOUT_S = 3.0
ABORT_DEADLINE_S = 2.0
WEDGE = "engine.step=hang"
BUILTIN = "builtin:smollm2-135m"
EX_SOFTWARE, EX_CONFIG = 70, 78


def now() -> float:
    return time.time()


# --- the supervisor: systemd's restart logic, for one node ----------------------------------


@dataclass
class UnitEvent:
    at: float
    what: str  # "started", "exited", "failed", "stopped"
    detail: str = ""


class Supervisor:
    """One node under systemd's rules (deploy/neuron.service): `Restart=on-failure` after
    `restart_sec`, at most `burst` starts in `interval_s` (then `failed`, as systemd's
    start-limit-hit), no restart after exit 0 (a drain) or 78 (a bad config).

    `start(env_once=...)` is `systemctl start` with an environment for that start only;
    `env_always` is the unit's own environment (every start, restarts included).
    """

    def __init__(
        self,
        name: str,
        config: Path,
        log_dir: Path,
        *,
        restart_sec: float,
        burst: int,
        interval_s: float = 600.0,
        env_always: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.log_dir = log_dir
        self.restart_sec = restart_sec
        self.burst = burst
        self.interval_s = interval_s
        self.env_always = dict(env_always or {})
        self.state = "inactive"  # inactive, active, auto-restart, failed
        self.events: list[UnitEvent] = []
        self.starts: list[float] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._watcher: threading.Thread | None = None

    # systemctl start / stop / reset-failed
    def start(self, env_once: Mapping[str, str] | None = None) -> bool:
        with self._lock:
            return self._spawn(env_once)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (a drain) and wait for the exit; no restart follows."""
        with self._lock:
            proc, self._stopping = self.proc, True
            if proc is None or proc.poll() is not None:
                return None if proc is None else proc.returncode
            self.state = "deactivating"  # the watcher leaves this exit alone
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()  # TimeoutStopSec
            code = proc.wait(10)
        with self._lock:
            self.events.append(UnitEvent(now(), "exited", str(code)))
            self.state = "inactive"
        return code

    def reset_failed(self) -> None:
        with self._lock:
            self.starts.clear()
            if self.state == "failed":
                self.state = "inactive"

    def kill(self, signum: int) -> None:
        """A signal from outside (e.g. SIGKILL by the OOM killer or a person)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def close(self) -> None:
        self._closed = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def log_paths(self) -> list[Path]:
        return sorted(self.log_dir.glob(f"{self.name}-start*.log"))

    def _spawn(self, env_once: Mapping[str, str] | None) -> bool:
        t = now()
        recent = [s for s in self.starts if t - s < self.interval_s]
        if len(recent) >= self.burst:
            self.state = "failed"
            self.events.append(UnitEvent(t, "failed", "start-limit-hit"))
            return False
        self.starts.append(t)
        env = {**self.env_always, **(env_once or {})}
        log_path = self.log_dir / f"{self.name}-start{len(self.events):03d}.log"
        self._stopping = False
        self.proc = spawn_neuron(self.config, log_path, env)
        self.state = "active"
        self.events.append(UnitEvent(t, "started", f"pid {self.proc.pid} {sorted(env)}"))
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name=f"sup-{self.name}")
            self._watcher.daemon = True
            self._watcher.start()
        return True

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(0.05)
            with self._lock:
                proc = self.proc
                if proc is None or self.state != "active" or proc.poll() is None:
                    continue
                code = proc.returncode
                self.events.append(UnitEvent(now(), "exited", str(code)))
                if self._stopping or code in (0, EX_CONFIG):
                    self.state = "inactive" if code in (0, -signal.SIGTERM) else "failed"
                    continue
                self.state = "auto-restart"
            time.sleep(self.restart_sec)
            with self._lock:
                if self.state == "auto-restart" and not self._closed:
                    self._spawn(None)


def node_healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def write_node_config(path: Path, port: int, state_dir: Path, source: str) -> None:
    model_dir = Path(source).parent if not source.startswith("builtin:") else state_dir
    path.write_text(
        f"""[server]
listen = ["127.0.0.1:{port}"]
drain_timeout_s = 20

[node]
state_dir = "{state_dir}"
model_dirs = ["{model_dir}"]

[watchdog]
step_timeout_s = {STEP_TIMEOUT_S}
abort_deadline_s = {ABORT_DEADLINE_S}
probe_interval_s = 3600

[[default_models]]
name = "{MODEL}"
source = "{source}"
devices = "cpu"
max_batch = 2
context = 512
"""
    )


# --- HAProxy ---------------------------------------------------------------------------------


def drill_haproxy_config(shipped: str, port: int, sock: Path, servers: Mapping[str, int]) -> str:
    """The shipped config with the drill's addresses: the bind, stats socket, log target and
    server lines are replaced; everything else (checks, retries, timeouts) is kept as is.
    neuron1 starts in maintenance (`disabled`): it enters rotation when its scenario begins."""

    def sub(pattern: str, repl: str, text: str) -> str:
        out, n = re.subn(pattern, repl, text, flags=re.M)
        if n == 0:
            raise ValueError(f"deploy/haproxy/neuron.cfg has no line matching {pattern!r}")
        return out

    text = sub(r"^(\s*)bind \S+$", rf"\1bind 127.0.0.1:{port}", shipped)
    text = sub(r"^(\s*)stats socket \S+", rf"\1stats socket {sock}", text)
    text = sub(r"^(\s*)log /dev/log (\S+)$", r"\1log stdout format raw \2", text)
    lines = [
        f"    server {name} 127.0.0.1:{p}" + (" disabled" if name == NODES[0] else "")
        for name, p in servers.items()
    ]
    text = re.sub(r"^\s*server \S+ \S+\n", "", text, flags=re.M)
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"


class HAProxy:
    """HAProxy in the foreground; a poller records every server state change (100 ms)."""

    def __init__(self, config: Path, sock: Path, log_path: Path) -> None:
        self.sock = sock
        self.transitions: dict[str, list[tuple[float, str]]] = {n: [] for n in NODES}
        self._closed = False
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["haproxy", "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 10
        while not sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("haproxy did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.05)
        self._poller = threading.Thread(target=self._poll, name="haproxy-stat", daemon=True)
        self._poller.start()

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(str(self.sock))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def statuses(self) -> dict[str, str]:
        text = self.command("show stat").lstrip("# ")
        return {
            row["svname"]: row["status"].split()[0]
            for row in csv.DictReader(io.StringIO(text))
            if row.get("pxname") == BACKEND and row.get("svname") in NODES
        }

    def status(self, server: str) -> str:
        history = self.transitions[server]
        return history[-1][1] if history else "?"

    def _poll(self) -> None:
        while not self._closed:
            try:
                current = self.statuses()
            except OSError:
                current = {}
            t = now()
            for name, status in current.items():
                if self.status(name) != status:
                    self.transitions[name].append((t, status))
            time.sleep(0.1)

    def first(self, server: str, status: str, after: float) -> float | None:
        return next(
            (t for t, s in self.transitions[server] if t >= after and s.startswith(status)), None
        )

    def close(self) -> None:
        self._closed = True
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


# --- the client load -------------------------------------------------------------------------


@dataclass
class Outcome:
    started: float
    ended: float
    stream: bool
    status: int | None  # HTTP status, None if none came
    server: str | None  # X-Neuron-Server: the node that answered
    ok: bool
    how: str  # "ok", "[DONE]", "http 503", "error event", "connection error: …", "no [DONE]"
    canary: bool = False  # sent by the drill the moment a doomed node entered rotation


PROMPTS = ("Count from one to twenty in words.", "Name the planets of the solar system.")


class Load:
    """`clients` threads, each with one HTTP/2 connection to the proxy, alternating streamed
    (48 tokens) and non-streamed (8 tokens) chat completions until stopped."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url = url
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"client-{i}", daemon=True)
            for i in range(clients)
        ]
        for thread in self._threads:
            thread.start()

    def canary(self) -> None:
        """One streamed request, now, on a connection of its own (see Drill.watch_rotation)."""

        def go() -> None:
            with httpx.Client(http1=False, http2=True, timeout=60.0) as client:
                outcome = self._one(client, True, PROMPTS[0])
            outcome.canary = True
            self.outcomes.append(outcome)

        thread = threading.Thread(target=go, name="canary", daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)

    def _run(self, index: int) -> None:
        timeout = httpx.Timeout(60.0, connect=5.0)
        with httpx.Client(http1=False, http2=True, timeout=timeout) as client:
            n = index
            while not self._stop.is_set():
                stream = n % 2 == 0
                n += 1
                outcome = self._one(client, stream, PROMPTS[n % len(PROMPTS)])
                self.outcomes.append(outcome)
                if not outcome.ok:
                    time.sleep(0.2)  # no tight loop of errors

    def _one(self, client: httpx.Client, stream: bool, prompt: str) -> Outcome:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 48 if stream else 8,
            "temperature": 0,
            "stream": stream,
        }
        started = now()
        status: int | None = None
        server: str | None = None
        try:
            if not stream:
                r = client.post(f"{self.url}/v1/chat/completions", json=body)
                status, server = r.status_code, r.headers.get("x-neuron-server")
                ok = status == 200 and bool(r.json().get("choices"))
                how = "ok" if ok else f"http {status}"
            else:
                with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                    status, server = r.status_code, r.headers.get("x-neuron-server")
                    how = "no [DONE]"
                    if status != 200:
                        r.read()
                        how = f"http {status}"
                    else:
                        for line in r.iter_lines():
                            if line == "data: [DONE]":
                                how = "[DONE]"
                            elif line.startswith('data: {"error"'):
                                how = "error event"
                ok = how == "[DONE]"
        except httpx.HTTPError as exc:
            ok, how = False, f"connection error: {type(exc).__name__}"
        return Outcome(started, now(), stream, status, server, ok, how)


# --- the scenarios ---------------------------------------------------------------------------


@dataclass
class ScenarioResult:
    name: str
    node: str
    fault_at: float
    out_of_rotation_s: float | None
    back_in_rotation_s: float | None  # None: never (scenario d: it must not come back)
    requests_after_fault: int
    errors_after_fault: int
    errors: list[str]
    inflight_on_node: list[str]  # "stream: [DONE]", "stream: connection error: …", …
    canaries: list[str]  # the streams sent as the doomed node entered rotation, how they ended
    unit_events: list[str]
    final_unit_state: str
    final_proxy_status: str
    times_back_in_rotation: int = 0
    slowest_after_fault_s: float = 0.0  # what the retries cost: the longest request from then on
    notes: list[str] = field(default_factory=list)


def fired_at(sup: Supervisor, after: float) -> float | None:
    """When the node's `engine.step` failpoint fired (its log line), at or after `after`."""
    for path in sup.log_paths():
        for line in path.read_text(errors="replace").splitlines():
            if "failpoint engine.step fired" in line:
                t = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if t >= after - 1.0:  # the log's millisecond resolution
                    return t
    return None


class Drill:
    def __init__(self, root: Path, *, restart_sec: float, burst: int, source: str) -> None:
        self.root = root
        ports = {name: free_port() for name in NODES}
        self.sups: dict[str, Supervisor] = {}
        for name, port in ports.items():
            config = root / f"{name}.toml"
            write_node_config(config, port, root / f"{name}-state", source)
            self.sups[name] = Supervisor(
                name,
                config,
                root,
                restart_sec=restart_sec,
                burst=burst,
                # One thread each: three nodes on a small machine. With torch's default (every
                # core) their OpenMP pools spun against each other and start-up took minutes.
                env_always={"OMP_NUM_THREADS": "1", "XDG_STATE_HOME": str(root / "xdg")},
            )
        self.ports = ports
        self.proxy_port = free_port()
        self.haproxy: HAProxy | None = None
        self.load: Load | None = None
        self.deadline: float | None = None  # time.monotonic() by which every wait must end

    def start(self, ready_timeout_s: float) -> None:
        self.sups[NODES[0]].start(env_once={"NEURON_FAILPOINTS": WEDGE})
        for name in NODES[1:]:
            self.sups[name].start()
        for name, port in self.ports.items():  # ready before the proxy's first check
            self.wait_until(
                lambda port=port: node_healthy(port), ready_timeout_s, f"{name} /health 200"
            )
        sock = self.root / "haproxy.sock"
        cfg = self.root / "haproxy.cfg"
        cfg.write_text(
            drill_haproxy_config(HAPROXY_CFG.read_text(), self.proxy_port, sock, self.ports)
        )
        self.haproxy = HAProxy(cfg, sock, self.root / "haproxy.log")
        self.wait_until(
            lambda: all(self.proxy().status(n) == "UP" for n in NODES[1:]),
            ready_timeout_s,
            "neuron2 and neuron3 UP in HAProxy",
        )
        self.load = Load(f"http://127.0.0.1:{self.proxy_port}")
        time.sleep(2.0)  # a baseline: traffic on two nodes

    def proxy(self) -> HAProxy:
        assert self.haproxy is not None
        return self.haproxy

    def wait_until(self, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not in time ({timeout_s:g}s): {what}\n{self.debug()}")
            time.sleep(0.1)

    def debug(self) -> str:
        lines = [f"{n}: {s.state} {[asdict(e) for e in s.events]}" for n, s in self.sups.items()]
        lines.append(f"haproxy: {self.proxy().transitions if self.haproxy else None}")
        return "\n".join(lines)

    def close(self) -> None:
        if self.load is not None:
            self.load.stop()
        for sup in self.sups.values():
            sup.close()
        if self.haproxy is not None:
            self.haproxy.close()

    # (a)
    @contextmanager
    def watch_rotation(self, node: str) -> Iterator[None]:
        """Each time `node` enters rotation, send a canary stream through the proxy at once:
        leastconn gives it to the node that has none in flight, so a node armed to wedge on its
        first step is wedged by a stream (the hard case: a stream's headers go out early),
        whichever request the clients would have sent it first."""
        stop = threading.Event()

        def watch() -> None:
            seen = len(self.proxy().transitions[node])
            while not stop.is_set():
                history = self.proxy().transitions[node]
                for _, status in history[seen:]:
                    if status == "UP" and self.load is not None:
                        self.load.canary()
                seen = len(history)
                time.sleep(0.02)

        thread = threading.Thread(target=watch, name=f"watch-{node}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5)

    def wedge(self, timeout_s: float) -> ScenarioResult:
        node, sup = NODES[0], self.sups[NODES[0]]
        with self.watch_rotation(node):
            return self._wedge(node, sup, timeout_s)

    def _wedge(self, node: str, sup: Supervisor, timeout_s: float) -> ScenarioResult:
        begin = now()
        self.proxy().command(f"set server {BACKEND}/{node} state ready")
        self.wait_until(lambda: fired_at(sup, begin) is not None, timeout_s, "the wedge fired")
        fault = fired_at(sup, begin)
        assert fault is not None
        self.wait_until(
            lambda: len(sup.starts) >= 2 and self.proxy().status(node) == "UP",
            timeout_s,
            f"{node} restarted and back in rotation",
        )
        return self.result("a wedge (exit 70, restart)", node, fault, exposed=begin)

    # (b)
    def drain(self, timeout_s: float) -> ScenarioResult:
        node, sup = NODES[1], self.sups[NODES[1]]
        fault = now()
        code = sup.stop()
        sup.start()
        self.wait_until(lambda: self.proxy().status(node) == "UP", timeout_s, f"{node} back")
        result = self.result("b SIGTERM drain, restart", node, fault)
        result.notes.append(f"drain exit code {code}")
        return result

    # (c)
    def kill(self, timeout_s: float) -> ScenarioResult:
        node, sup = NODES[2], self.sups[NODES[2]]
        fault = now()
        sup.kill(signal.SIGKILL)
        self.wait_until(
            lambda: len(sup.starts) >= 2 and self.proxy().status(node) == "UP",
            timeout_s,
            f"{node} restarted and back in rotation",
        )
        return self.result("c SIGKILL, restart", node, fault)

    # (d)
    def bad_start(self, timeout_s: float, settle_s: float) -> ScenarioResult:
        node, sup = NODES[0], self.sups[NODES[0]]
        sup.stop()  # an operator deploys a build that wedges on its first step, every start
        sup.reset_failed()
        sup.env_always["NEURON_FAILPOINTS"] = WEDGE
        begin = now()
        with self.watch_rotation(node):
            sup.start()
            self.wait_until(lambda: fired_at(sup, begin) is not None, timeout_s, "it wedged")
            fault = fired_at(sup, begin)
            assert fault is not None
            self.wait_until(lambda: sup.state == "failed", timeout_s, f"{node} failed")
            time.sleep(settle_s)  # it stays out: nothing restarts it, no check passes
        result = self.result("d wedges on every start", node, fault, exposed=begin)
        result.back_in_rotation_s = None
        return result

    def result(
        self, name: str, node: str, fault: float, exposed: float | None = None
    ) -> ScenarioResult:
        """`fault`: when the node failed; `exposed`: for a node doomed from its start (armed to
        wedge on its first step), when the scenario began: requests from then on count."""
        proxy, sup = self.proxy(), self.sups[node]
        assert self.load is not None
        end = now()
        down = proxy.first(node, "DOWN", fault) or proxy.first(node, "MAINT", fault)
        ups = [t for t, s in proxy.transitions[node] if t > fault and s == "UP"]
        outcomes = list(self.load.outcomes)
        since = fault if exposed is None else min(fault, exposed)
        after = [o for o in outcomes if since <= o.started <= end]
        errors = [o for o in after if not o.ok]
        inflight = [
            o for o in outcomes if o.started < fault < o.ended and o.server == node and o.stream
        ]
        return ScenarioResult(
            name=name,
            node=node,
            fault_at=fault,
            out_of_rotation_s=None if down is None else round(down - fault, 2),
            back_in_rotation_s=round(ups[-1] - fault, 1) if ups else None,
            requests_after_fault=len(after),
            errors_after_fault=len(errors),
            errors=[f"{'stream' if o.stream else 'json'} {o.how} via {o.server}" for o in errors],
            inflight_on_node=[f"stream: {o.how}" for o in inflight if not o.canary],
            canaries=[
                f"{o.how} via {o.server}" for o in outcomes if o.canary and o.started >= since
            ],
            unit_events=[
                f"+{e.at - fault:.1f}s {e.what} {e.detail.split(' ')[0]}"
                for e in sup.events
                if e.at >= since
            ],
            final_unit_state=sup.state,
            final_proxy_status=proxy.status(node),
            times_back_in_rotation=len(ups),
            slowest_after_fault_s=round(max((o.ended - o.started for o in after), default=0.0), 1),
        )


@contextmanager
def drill(
    restart_sec: float = 1.0,
    burst: int = 4,
    root: Path | None = None,
    source: str = BUILTIN,
) -> Iterator[Drill]:
    """A drill in `root` (default a temporary directory), torn down on the way out. `source`:
    the nodes' model (a local GGUF path, or the built-in model)."""
    if shutil.which("haproxy") is None:
        raise FileNotFoundError("haproxy is not installed (Debian: apt-get install haproxy)")
    with tempfile.TemporaryDirectory(prefix="router-drill-") as tmp:
        d = Drill(root or Path(tmp), restart_sec=restart_sec, burst=burst, source=source)
        try:
            yield d
        finally:
            d.close()


def run_all(
    d: Drill, timeout_s: float = 300.0, total_s: float | None = None
) -> list[ScenarioResult]:
    """The four scenarios, one after the other, each once the previous node is back. Every
    wait gives up after `timeout_s`, and all of them by `total_s` from now (TimeoutError)."""
    if total_s is not None:
        d.deadline = time.monotonic() + total_s
    d.start(timeout_s)
    results = [d.wedge(timeout_s)]
    time.sleep(2.0)
    results.append(d.drain(timeout_s))
    time.sleep(2.0)
    results.append(d.kill(timeout_s))
    time.sleep(2.0)
    results.append(d.bad_start(timeout_s * 2, settle_s=5.0))
    return results


def table(results: list[ScenarioResult]) -> str:
    def s(x: float | None) -> str:
        return "never" if x is None else f"{x:g}"

    rows = [
        "| scenario | out of rotation after (s) | client errors / requests after the fault "
        "| streams on the node at the fault, how they ended | back in rotation after (s) "
        "| slowest request after the fault (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        caught = r.inflight_on_node + [f"canary stream: {c}" for c in r.canaries]
        inflight = ", ".join(caught) or "none"
        back = s(r.back_in_rotation_s)
        if r.name.startswith("d"):
            back = f"never: `{r.final_unit_state}` after {r.times_back_in_rotation} returns"
        rows.append(
            f"| {r.name} | {s(r.out_of_rotation_s)} | {r.errors_after_fault} / "
            f"{r.requests_after_fault} | {inflight} | {back} | {r.slowest_after_fault_s:g} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--restart-sec", type=float, default=1.0)
    parser.add_argument("--start-limit-burst", type=int, default=4)
    parser.add_argument("--model", default=BUILTIN, help="a local GGUF path (default: %(default)s)")
    parser.add_argument("--keep", type=Path, help="keep logs and configs in this directory")
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with drill(args.restart_sec, args.start_limit_burst, args.keep, args.model) as d:
        started = time.monotonic()
        results = run_all(d)
        print(table(results))
        print(f"\n(drill took {time.monotonic() - started:.0f}s)")
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
        for r in results:
            print(json.dumps(asdict(r)))


if __name__ == "__main__":
    main()
