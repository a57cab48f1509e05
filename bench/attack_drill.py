"""Replay issue 25's attacks against a running neuron and print what each did.

    python bench/attack_drill.py                      # starts the built-in model on the CPU
    python bench/attack_drill.py --url http://127.0.0.1:8080 --pid 1234 --api-key KEY

For every attack: the status codes the attacker saw, the daemon's RSS growth, the slowest
/health answer while it ran (probed every 100 ms from another connection), whether a normal
client's request completed meanwhile, and whether the process survived. The issue's bar:
survives, /health within 1 s, RSS within 500 MB of its start, other clients served.

The network attacks live here; bench/attacks_grammar.py and bench/attacks_modelfiles.py add
theirs when present (functions named `attack_*` taking `(base_url, api_key)` or
`(base_url, admin_key)` and returning AttackRow lists). Without `--pid` (a remote daemon) RSS
and survival are not measured. Timings on a shared machine are noisy: read them as ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib
import os
import resource
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_rows import AttackRow, print_rows
from daemon_harness import MODEL, cpu_seconds, rss_bytes, running_daemon

HEALTH_PERIOD_S = 0.1
HEALTH_LIMIT_S = 1.0


@dataclass
class Target:
    url: str
    pid: int | None
    api_key: str | None
    admin_key: str | None
    model: str = MODEL
    model_dir: Path | None = None  # one of the daemon's node.model_dirs (hostile model files)

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# --- measuring around an attack ---------------------------------------------------------------


@dataclass
class HealthProbe:
    target: Target
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        host, port = self.target.host_port
        while not self.stop.wait(HEALTH_PERIOD_S):
            started = time.perf_counter()
            try:
                conn = http.client.HTTPConnection(host, port, timeout=5)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
            except (OSError, http.client.HTTPException):
                ok = False
            took = time.perf_counter() - started
            self.latencies.append(took)
            if not ok or took > HEALTH_LIMIT_S:
                self.failures += 1


def _alive(pid: int | None) -> bool | None:
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # a zombie (exited, not yet reaped by the harness) is not alive
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return False
    return True


def _other_client_ok(target: Target) -> bool:
    try:
        with httpx.Client(base_url=target.url, timeout=30, headers=target.headers()) as client:
            r = client.post(
                "/v1/chat/completions",
                json={"model": target.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            )  # fmt: skip
            return r.status_code == 200
    except httpx.HTTPError:
        return False


def measure(target: Target, rows_of: Callable[[], list[AttackRow]]) -> list[AttackRow]:
    """Run one attack (which returns its rows) with the probes around it."""
    rss0 = rss_bytes(target.pid) if target.pid and _alive(target.pid) else None
    probe = HealthProbe(target)
    thread = threading.Thread(target=probe.run, daemon=True)
    thread.start()
    others: list[bool] = []
    other = threading.Thread(target=lambda: others.append(_other_client_ok(target)), daemon=True)
    try:
        other.start()
        rows = rows_of()
    except Exception as exc:  # an attack that fails is a row, not the end of the drill
        rows = [AttackRow(getattr(rows_of, "__name__", "?"), detail=f"drill error: {exc!r}")]
    finally:
        other.join(60)
        probe.stop.set()
        thread.join(10)
    alive = _alive(target.pid)
    rss1 = rss_bytes(target.pid) if target.pid and alive else None
    for row in rows:
        row.survived = alive if row.survived is None else row.survived
        if rss0 is not None and rss1 is not None:
            row.rss_growth_mb = (rss1 - rss0) / 1e6
        row.health_p_max_s = max(probe.latencies, default=None)
        row.health_failures = probe.failures
        row.others_ok = bool(others and others[0])
    return rows


# --- raw HTTP/2 ---------------------------------------------------------------------------


class RawH2:
    """A blocking `h2` client on a plain socket: sends whatever frames an attack wants."""

    def __init__(self, target: Target) -> None:
        self.sock = socket.create_connection(target.host_port, timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.authority = "{}:{}".format(*target.host_port)
        self.auth = target.headers()
        self.goaway: int | None = None
        self.closed = False
        self.statuses: dict[int, int] = {}
        self.conn.initiate_connection()
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.closed:
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True

    def open_stream(self, path: str, *, end: bool) -> int:
        sid: int = self.conn.get_next_available_stream_id()
        headers = [(":method", "POST"), (":path", path), (":scheme", "http")]
        headers += [(":authority", self.authority), ("content-type", "application/json")]
        headers += [(k.lower(), v) for k, v in self.auth.items()]
        self.conn.send_headers(sid, headers, end_stream=end)
        return sid

    def drain(self, seconds: float) -> None:
        """Read (and acknowledge) for up to `seconds`, or until the server closes."""
        deadline = time.monotonic() + seconds
        while not self.closed and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                raw = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            except OSError:
                raw = b""
            if not raw:
                self.closed = True
                break
            try:
                events = self.conn.receive_data(raw)
            except h2.exceptions.ProtocolError:
                self.closed = True
                break
            for event in events:
                if isinstance(event, h2.events.ConnectionTerminated):
                    self.goaway = int(event.error_code)
                elif isinstance(event, h2.events.ResponseReceived):
                    self.statuses[event.stream_id] = int(dict(event.headers)[b":status"])
            self.flush()

    def outcome(self) -> str:
        if self.goaway is not None:
            return f"goaway:{h2.errors.ErrorCodes(self.goaway).name}"
        return "closed" if self.closed else "open"

    def close(self) -> None:
        self.sock.close()


def _flood(target: Target, name: str, frames: int, send: Callable[[RawH2, int], None]) -> AttackRow:
    client = RawH2(target)
    sent = 0
    for i in range(frames):
        if client.closed:
            break
        send(client, i)
        sent += 1
        if i % 500 == 499:
            client.flush()
            client.drain(0.0)
    client.flush()
    client.drain(2.0)
    client.close()
    return AttackRow(name, Counter([client.outcome()]), f"{sent} of {frames} frames sent")


def attack_ping_flood(target: Target) -> list[AttackRow]:
    return [
        _flood(target, "h2 PING flood", 500_000, lambda c, i: c.conn.ping(i.to_bytes(8, "big")))
    ]


def attack_settings_flood(target: Target) -> list[AttackRow]:
    def send(client: RawH2, i: int) -> None:
        client.conn.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0})

    return [_flood(target, "h2 SETTINGS flood", 200_000, send)]


def attack_rapid_reset(target: Target, connections: int = 50, per: int = 1000) -> list[AttackRow]:
    before = cpu_seconds(target.pid) if target.pid else None
    outcomes: Counter[str] = Counter()
    for _ in range(connections):
        client = RawH2(target)
        for _ in range(per):
            if client.closed:
                break
            sid = client.open_stream("/v1/chat/completions", end=False)
            client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        client.flush()
        client.drain(1.0)
        outcomes[client.outcome()] += 1
        client.close()
    cost = f", server CPU {cpu_seconds(target.pid) - before:.1f} s" if before is not None else ""
    return [AttackRow(f"h2 rapid reset {connections}x{per}", outcomes, f"connections{cost}")]


def attack_one_byte_connections(target: Target, count: int = 4096) -> list[AttackRow]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 512), hard))
    held: list[socket.socket] = []
    refused = 0
    try:
        host, port = target.host_port
        for i in range(count):
            try:
                # From 16 loopback addresses when the daemon is local (the per-peer limit
                # would stop one address alone); the other client comes from 127.0.0.1.
                source = (f"127.0.0.{2 + i % 16}", 0) if host.startswith("127.") else None
                sock = socket.create_connection((host, port), timeout=5, source_address=source)
                sock.sendall(b"P")
                held.append(sock)
            except OSError:
                refused += 1
        started = time.perf_counter()
        ok = _other_client_ok(target)  # while every socket is held
        took = time.perf_counter() - started
    finally:
        for sock in held:
            sock.close()
    return [
        AttackRow(
            f"{count} one-byte connections",
            Counter({"held": len(held), "refused": refused}),
            f"another client while held: {'ok' if ok else 'FAILED'} in {took:.2f} s",
            others_ok=ok,
        )
    ]


def attack_big_body_h2(target: Target) -> list[AttackRow]:
    body = b'{"model":"%s","messages":[{"role":"user","content":"%s"}]}' % (
        target.model.encode(),
        b"x" * 3_000_000,
    )
    statuses: Counter[str] = Counter()
    with httpx.Client(
        http1=False, http2=True, base_url=target.url, timeout=30, headers=target.headers()
    ) as client:
        for _ in range(3):
            try:
                statuses[str(client.post("/v1/chat/completions", content=body).status_code)] += 1
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
    return [AttackRow("3 MB chat body over h2", statuses, "clean 413 expected, no protocol error")]


def _http_5xx(target: Target) -> float:
    r = httpx.get(target.url + "/metrics", headers=_operator_headers(target), timeout=10)
    total = 0.0
    for line in r.text.splitlines():
        if line.startswith("neuron_http_requests_total{") and 'status="5' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _operator_headers(target: Target) -> dict[str, str]:
    key = target.admin_key or target.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def attack_resets_before_body(target: Target, count: int = 200) -> list[AttackRow]:
    before = _http_5xx(target)
    client = RawH2(target)
    for _ in range(count):
        sid = client.open_stream("/v1/chat/completions", end=False)
        client.flush()
        client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        client.flush()
    client.drain(1.0)
    client.close()
    time.sleep(0.5)
    counted = _http_5xx(target) - before
    return [
        AttackRow(
            f"{count} h2 resets before the body",
            Counter({"5xx counted": int(counted)}),
            "0 expected",
        )
    ]


def attack_huge_model_value(target: Target) -> list[AttackRow]:
    doc = {"model": "m" * 900_000, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        target.url + "/v1/chat/completions", json=doc, headers=target.headers(), timeout=30
    )
    return [
        AttackRow(
            "900 KB model value", Counter([str(r.status_code)]), f"answer {len(r.content)} bytes"
        )
    ]


def attack_prefix_cache_timing(target: Target, tries: int = 3) -> list[AttackRow]:
    """A victim's secret system prompt, unsalted and then salted; an attacker guesses it
    without the salt. Unsalted, the right guess is a cache hit (the leak, as a control)."""
    return [_prefix_timing(target, tries, salted) for salted in (False, True)]


def _prefix_timing(target: Target, tries: int, salted: bool) -> AttackRow:

    def ttft(system: str, salt: str | None) -> float:
        """Time to a one-token answer: prefill plus one step (a streamed first chunk would
        carry only the role, before any prefill)."""
        doc: dict[str, object] = {
            "model": target.model, "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        }  # fmt: skip
        if salt:
            doc["cache_salt"] = salt
        started = time.perf_counter()
        r = httpx.post(
            target.url + "/v1/chat/completions", json=doc, headers=target.headers(), timeout=60
        )
        r.raise_for_status()
        return time.perf_counter() - started

    rights, wrongs = [], []
    for n in range(tries):  # each try a new victim: a guess, once made, is cached itself
        secret = f"You are the assistant of ACME-{salted}-{n}. The vault PIN is 4711. " * 40
        ttft(secret, "victim-salt-5f1c" if salted else None)  # the victim's prompt, cached
        rights.append(ttft(secret, None))
        wrongs.append(ttft(secret.replace("4711", "0000"), None))
    right, wrong = min(rights), min(wrongs)
    return AttackRow(
        f"prefix-cache timing (victim {'salted' if salted else 'unsalted: control'})",
        Counter({"200": 3 * tries}),
        f"TTFT right guess {right:.3f} s vs wrong {wrong:.3f} s (a leak: right << wrong)",
    )


def attack_open_endpoints(target: Target) -> list[AttackRow]:
    statuses: Counter[str] = Counter()
    metrics = httpx.get(target.url + "/metrics", timeout=10)
    statuses[f"/metrics {metrics.status_code}"] += 1
    node = httpx.get(target.url + "/v1/node", headers=target.headers(), timeout=10)
    statuses[f"/v1/node {node.status_code}"] += 1
    paths = node.status_code == 200 and '"/' in node.text
    detail = "file paths shown" if paths else "no file paths"
    return [
        AttackRow("open /metrics, /v1/node paths", statuses, detail + " (with the API key given)")
    ]


NETWORK_ATTACKS: list[Callable[[Target], list[AttackRow]]] = [
    attack_big_body_h2,
    attack_resets_before_body,
    attack_huge_model_value,
    attack_open_endpoints,
    attack_prefix_cache_timing,
    attack_ping_flood,
    attack_settings_flood,
    attack_rapid_reset,
    attack_one_byte_connections,
]


# --- other engineers' attacks ------------------------------------------------------------------


def optional_attacks(target: Target) -> Iterator[tuple[str, Callable[[], list[AttackRow]]]]:
    """The attacks of bench/attacks_grammar.py and bench/attacks_modelfiles.py (when present),
    bound to the target (their rows are the drill's own `AttackRow`s)."""
    grammar = _optional_module("attacks_grammar")
    if grammar is not None:
        for fn in grammar.ATTACKS:

            def run_grammar(fn: Callable[..., AttackRow] = fn) -> list[AttackRow]:
                return [fn(target.url, target.pid)]

            yield f"grammar.{fn.__name__}", run_grammar
    modelfiles = _optional_module("attacks_modelfiles")
    if modelfiles is None:
        return
    if target.model_dir is None:
        print("(attacks_modelfiles: no --model-dir: skipped)", file=sys.stderr)
        return
    for name in modelfiles.ATTACKS:

        def run_modelfile(name: str = name) -> list[AttackRow]:
            rows: list[AttackRow] = modelfiles.run_modelfile_attacks(
                target.url,
                target.admin_key,
                model_dir=target.model_dir,
                api_key=target.api_key,
                pid=target.pid,
                only=[name],
            )
            return rows

        yield f"modelfiles.{name}", run_modelfile


def _optional_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        print(f"({name} not present: skipped)", file=sys.stderr)
        return None


# --- the table -------------------------------------------------------------------------------


def run_drill(target: Target, only: str | None) -> list[AttackRow]:
    rows: list[AttackRow] = []
    attacks: list[tuple[str, Callable[[], list[AttackRow]]]] = [
        (fn.__name__, (lambda fn=fn: fn(target))) for fn in NETWORK_ATTACKS
    ]
    attacks += list(optional_attacks(target))
    for name, attack in attacks:
        if only and only not in name:
            continue
        print(f"... {name}", file=sys.stderr, flush=True)
        rows += measure(target, attack)
        if target.pid is not None and not _alive(target.pid):
            print("the daemon died: stopping the drill", file=sys.stderr)
            break
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running daemon (default: start the built-in model)")
    parser.add_argument("--pid", type=int, help="its process id, for RSS and survival")
    parser.add_argument("--api-key")
    parser.add_argument("--admin-key")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--only", help="run the attacks whose name contains this")
    parser.add_argument(
        "--model-dir", type=Path, help="one of the daemon's node.model_dirs (model-file attacks)"
    )
    args = parser.parse_args()
    if args.url:
        target = Target(
            args.url.rstrip("/"),
            args.pid,
            args.api_key,
            args.admin_key,
            args.model,
            args.model_dir,
        )
        rows = run_drill(target, args.only)
    else:
        with (
            tempfile.TemporaryDirectory(prefix="neuron-attacks-") as tmp,
            running_daemon({"max_batch": 4, "context": 2048}, state_dir=Path(tmp)) as daemon,
        ):
            # the harness's node.model_dirs is its state directory
            target = Target(daemon.url, daemon.pid, None, None, model_dir=Path(tmp))
            rows = run_drill(target, args.only)
            print(f"(daemon log: {daemon.log_tail(3)!r})", file=sys.stderr)
    print_rows(rows)
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
