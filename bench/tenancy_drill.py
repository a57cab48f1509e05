"""Issue 47's drill: two tenants (API keys in a temporary config) against a real daemon on the
built-in model, on 127.0.0.1.

    python bench/tenancy_drill.py                 # ~3 minutes on 2 cores
    python bench/tenancy_drill.py --flood-streams 16 --seconds 30 --ttft-requests 20 --json out.json

1. Cross-key isolation: "calm" stores a response; "flood" tries GET, DELETE and
   previous_response_id on it (each should be a 404). A prefix-cache timing probe: calm sends
   a long secret system prompt, then calm repeats it (its own cache: fast) and flood sends the
   right guess and a wrong one of the same length (isolated: both slow). KV events: the
   default endpoint, the address the running daemon's PUB socket listens on, and whether a
   config with `tcp://*` is refused (check-config exit 78).
2. Calm alone: first-token time of sequential streamed chats, small json_schema requests
   (each a new schema: compiled), and tokens per second with 4 streams open.
3. The same while "flood" runs many long streams, slow (distinct) schemas at the bounds, huge
   patterns and HTTP/2 rapid resets. Calm's fair share is half the tokens generated in the
   window (weights 1:1, both backlogged).

Throughout: /health every 100 ms from another connection; the daemon's RSS at start, before
the flood and at the end, with the part that is its KV pool's pages written so far (reserved
at start by the config, committed as blocks are first written: `memory_mb`) and the rest.
Every loop is bounded (requests, rounds, seconds). Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.errors
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_drill import HealthProbe, RawH2, Target
from daemon_harness import MODEL, rss_bytes, write_config

from tests.neuron_process import free_port, run_neuron, spawn_neuron, stop_neuron, wait_ready

KEYS = {"calm": "calm-key-0123456789abcdef", "flood": "flood-key-0123456789abcdef"}
CHAT = "/v1/chat/completions"
HUGE_PATTERN = "^((X{100}){100}){100}$"
FLOOD_KINDS = ("schemas", "patterns", "resets")  # besides the long streams


# --- the daemon -----------------------------------------------------------------------------


def _tenants_toml(root: Path, kv_port: int) -> str:
    lines = []
    for name, key in KEYS.items():
        path = root / f"{name}.keys"
        path.write_text(key + "\n")
        path.chmod(0o600)
        lines += ["[[tenants]]", f'name = "{name}"', f'keys_file = "{path}"']
    lines += ["[kv_events]", "enabled = true", f'endpoint = "tcp://127.0.0.1:{kv_port}"']
    return "\n".join(lines) + "\n"


@contextmanager
def tenant_daemon(max_batch: int, keep_log: Path) -> Iterator[tuple[Target, Target, Path, int]]:
    """The built-in model with tenants calm and flood; yields their targets, the config, and
    the KV events port. The daemon's log is copied to `keep_log` at the end."""
    with tempfile.TemporaryDirectory(prefix="neuron-tenancy-") as tmp:
        root = Path(tmp)
        port, kv_port = free_port(), free_port()
        config = root / "neuron.toml"
        write_config(config, root / "state", port, {"max_batch": max_batch})
        with config.open("a") as f:
            f.write(_tenants_toml(root, kv_port))
        log = root / "neuron.log"
        process = spawn_neuron(config, log)
        try:
            wait_ready(process, port, log, 300)
            url = f"http://127.0.0.1:{port}"
            calm = Target(url, process.pid, KEYS["calm"], None)
            flood = Target(url, process.pid, KEYS["flood"], None)
            yield calm, flood, config, kv_port
        finally:
            stop_neuron(process)
            shutil.copyfile(log, keep_log)


def _client(target: Target, timeout: float = 300) -> httpx.Client:
    return httpx.Client(base_url=target.url, headers=target.headers(), timeout=timeout)


# --- isolation probes -----------------------------------------------------------------------


def probe_stored_responses(calm: Target, flood: Target) -> dict[str, Any]:
    with _client(calm) as c, _client(flood) as f:
        r = c.post(
            "/v1/responses", json={"model": MODEL, "input": "Say hi.", "max_output_tokens": 4}
        )
        rid = r.json()["id"]
        out = {
            "flood GET": f.get(f"/v1/responses/{rid}").status_code,
            "flood DELETE": f.delete(f"/v1/responses/{rid}").status_code,
            "flood previous_response_id": f.post(
                "/v1/responses",
                json={"model": MODEL, "input": "Go on.", "previous_response_id": rid, "max_output_tokens": 2},
            ).status_code,
            "calm GET after": c.get(f"/v1/responses/{rid}").status_code,
        }  # fmt: skip
    out["closed"] = all(v == 404 for k, v in out.items() if k.startswith("flood")) and (
        out["calm GET after"] == 200
    )
    return out


def _secret(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = [
        "amber",
        "basil",
        "cedar",
        "delta",
        "ember",
        "fjord",
        "grove",
        "harbor",
        "iris",
        "juniper",
        "kelp",
        "lotus",
    ]
    return " ".join(rng.choice(vocab) + str(rng.randrange(100)) for _ in range(words))


def _one_token_s(client: httpx.Client, system: str) -> float:
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
    }
    started = time.perf_counter()
    client.post(CHAT, json=body).raise_for_status()
    return time.perf_counter() - started


def probe_prefix_cache(
    calm: Target, flood: Target, tries: int = 2, words: int = 150
) -> dict[str, Any]:
    times: dict[str, list[float]] = {"calm first": [], "calm repeat": [], "flood right guess": [], "flood wrong guess": []}  # fmt: skip
    with _client(calm) as c, _client(flood) as f:
        for i in range(tries):
            secret, wrong = _secret(1000 + i, words), _secret(2000 + i, words)
            times["calm first"].append(_one_token_s(c, secret))
            times["calm repeat"].append(_one_token_s(c, secret))
            times["flood right guess"].append(_one_token_s(f, secret))
            times["flood wrong guess"].append(_one_token_s(f, wrong))
    out: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in times.items()}
    # closed: a right guess is no faster than a wrong one (within noise), while calm's own
    # repeat still hits its cache
    out["closed"] = out["flood right guess"] >= 0.6 * out["flood wrong guess"]
    return out


def _listen_addresses(pid: int, port: int) -> list[str]:
    """Addresses the process listens on at `port` (from /proc/PID/net/tcp and tcp6)."""
    found = []
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.rpartition(":")
            if state == "0A" and int(hexport, 16) == port:  # LISTEN
                found.append(_hex_address(addr))
    return found


def _hex_address(addr: str) -> str:
    if len(addr) == 8:
        return ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return "ipv6:" + addr


def probe_kv_events(pid: int, kv_port: int, config: Path) -> dict[str, Any]:
    wide = config.with_name("wide.toml")
    text = config.read_text().replace(f"tcp://127.0.0.1:{kv_port}", f"tcp://*:{kv_port}")
    wide.write_text(text)
    check = run_neuron("check-config", "--config", str(wide))
    from neuron_trio.config import KvEventsConfig  # the shipped default

    bound = _listen_addresses(pid, kv_port)
    return {
        "default endpoint": KvEventsConfig().endpoint,
        "live PUB listens on": bound,
        "tcp://* without allow_unauthenticated: exit": check.returncode,
        "closed": check.returncode == 78 and bool(bound) and all(a == "127.0.0.1" for a in bound),
    }


# --- load -----------------------------------------------------------------------------------


@dataclass
class TokenLog:
    """When each streamed content chunk arrived (a chunk is a token unless a client lags)."""

    stamps: list[float] = field(default_factory=list)

    def rate(self, start: float, end: float) -> float:
        return sum(1 for t in self.stamps if start <= t < end) / max(1e-9, end - start)


def stream_chat(
    client: httpx.Client,
    body: dict[str, Any],
    log: TokenLog | None,
    stop: threading.Event | None = None,
) -> float | None:
    """Stream one chat; the first content chunk's delay (None if none came). Leaves early
    (closing the stream: the daemon cancels the sequence) once `stop` is set."""
    started = time.perf_counter()
    first = None
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            time.sleep(1.0)  # a 429 or 503 (recovering): back off rather than spin the loop
            return None
        for line in r.iter_lines():
            if stop is not None and stop.is_set():
                break
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"] if '"choices":[{' in line else {}
            if delta.get("content"):
                now = time.perf_counter()
                first = first if first is not None else now - started
                if log is not None:
                    log.stamps.append(now)
    return first


def _chat_body(content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": random.randrange(1 << 30),
        "messages": [{"role": "user", "content": content}],
    }


def ttft_series(target: Target, count: int, first_number: int) -> list[float]:
    """First-token times of `count` sequential chats. Each names its own number (the prompt's
    second block, so no request finds another's in the prefix cache); `first_number` keeps
    the phases apart with as many digits, so the flood phase does not find the idle phase's
    prompts cached (it did: 4 tokens to prefill under the flood against 20 idle)."""
    out = []
    with _client(target) as c:
        for i in range(first_number, first_number + count):
            first = stream_chat(c, _chat_body(f"Name a colour ({i}).", 8), None)
            if first is not None:
                out.append(first)
    return out


def small_schemas(target: Target, count: int, tag: str) -> list[float]:
    """Requests with a new small schema each (compiled): seconds each."""
    out = []
    with _client(target) as c:
        for i in range(count):
            schema = {
                "type": "object",
                "properties": {f"{tag}{i}": {"type": "integer"}},
                "required": [f"{tag}{i}"],
            }
            body = _chat_body("Give a number as JSON.", 12)
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}  # fmt: skip
            started = time.perf_counter()
            c.post(CHAT, json=body)
            out.append(time.perf_counter() - started)
    return out


def backlog(target: Target, streams: int, seconds: float, log: TokenLog) -> tuple[float, float]:
    """`streams` streams kept open for `seconds`: the window (start, end) measured."""
    stop = threading.Event()

    def loop() -> None:
        with _client(target) as c:
            for _ in range(10_000):
                if stop.is_set():
                    return
                stream_chat(c, _chat_body("Tell a story about a lighthouse.", 64), log, stop)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    time.sleep(min(5.0, seconds / 4))  # both tenants settle into their shares
    start = time.perf_counter()
    time.sleep(seconds)
    end = time.perf_counter()
    stop.set()
    for t in threads:
        t.join(30)
    return start, end


# --- the flood ------------------------------------------------------------------------------


@dataclass
class Flood:
    target: Target
    streams: int
    max_tokens: int = 256
    kinds: tuple[str, ...] = FLOOD_KINDS
    log: TokenLog = field(default_factory=TokenLog)
    stop: threading.Event = field(default_factory=threading.Event)
    codes: dict[str, dict[str, int]] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def count(self, kind: str, code: object) -> None:
        bucket = self.codes.setdefault(kind, {})
        bucket[str(code)] = bucket.get(str(code), 0) + 1

    def start(self) -> None:
        every = {
            "schemas": self._slow_schemas,
            "patterns": self._huge_patterns,
            "resets": self._resets,
        }
        jobs: list[Callable[[], None]] = [self._long_streams] * self.streams
        jobs += [job for kind, job in every.items() if kind in self.kinds]
        for job in jobs:
            thread = threading.Thread(target=job, daemon=True)
            thread.start()
            self.threads.append(thread)

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _long_streams(self) -> None:
        prompt = "Write a very long essay about tides. " + _secret(random.randrange(1 << 20), 150)
        with _client(self.target) as c:
            for _ in range(1000):
                if self.stop.is_set():
                    return
                try:
                    stream_chat(c, _chat_body(prompt, self.max_tokens), self.log, self.stop)
                    self.count("long stream", "done")
                except httpx.HTTPError as exc:
                    self.count("long stream", type(exc).__name__)

    def _post_loop(self, kind: str, bodies: Iterator[dict[str, Any]], limit: int) -> None:
        with _client(self.target, timeout=120) as c:
            for _, body in zip(range(limit), bodies, strict=False):
                if self.stop.is_set():
                    return
                try:
                    code = c.post(CHAT, json=body).status_code
                    self.count(kind, code)
                    if code in (429, 503):
                        self.stop.wait(1.0)
                except httpx.HTTPError as exc:
                    self.count(kind, type(exc).__name__)

    def _slow_schemas(self) -> None:
        def bodies() -> Iterator[dict[str, Any]]:
            for i in range(10_000):
                tag = f"s{random.randrange(1 << 30)}-{i}-"
                schema = {"const": {f"{tag}k{j}": j for j in range(1_999)}}  # at the bounds
                body = _chat_body("Say hi.", 2)
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}  # fmt: skip
                yield body

        self._post_loop("slow schema", bodies(), 200)

    def _huge_patterns(self) -> None:
        def bodies() -> Iterator[dict[str, Any]]:
            for i in range(10_000):
                schema = {"type": "string", "pattern": HUGE_PATTERN.replace("X", chr(65 + i % 26))}
                body = _chat_body("Say hi.", 2)
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}  # fmt: skip
                yield body

        self._post_loop("huge pattern", bodies(), 20)

    def _resets(self, rounds: int = 3, connections: int = 10, per: int = 1000) -> None:
        """Rounds of `connections` × `per` HTTP/2 rapid resets, 5 s apart."""
        for _ in range(rounds):
            for _ in range(connections):
                if self.stop.is_set():
                    return
                try:
                    client = RawH2(self.target)
                except OSError as exc:
                    self.count("rapid reset connection", type(exc).__name__)
                    continue
                for _ in range(per):
                    if client.closed:
                        break
                    sid = client.open_stream(CHAT, end=False)
                    client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                client.flush()
                client.drain(0.5)
                self.count("rapid reset connection", client.outcome())
                client.close()
            if self.stop.wait(5.0):
                return


def _flood_main(flood: Flood, stop: Any, out: Any, nice: int) -> None:
    os.nice(nice)
    flood.start()
    stop.wait()
    flood.end()
    out.put((flood.log.stamps, flood.codes))


class FloodProcess:
    """The flood in a process of its own: its pure-Python HTTP/2 frames and SSE parsing
    would otherwise share the drill's one GIL with the threads that measure the other tenant
    (and /health). Timestamps are perf_counter(), CLOCK_MONOTONIC on Linux: comparable across
    the two processes.

    `nice`: the flood's own CPU priority. An attacker's client runs on its own machines; here
    it shares the node's 2 cores, and building one round of 10 x 1,000 rapid resets in pure
    Python takes it ~0.6 s of CPU (the node spends 0.13 s refusing them), a core for most of
    a second every 6 s, in which any step on the node runs at half speed or less. At nice 10
    (the default; 0: as in the third session's runs) that CPU comes after the node's."""

    def __init__(self, flood: Flood, nice: int = 10) -> None:
        ctx = multiprocessing.get_context("fork")
        self.stop = ctx.Event()
        self.out: Any = ctx.Queue()
        self.process = ctx.Process(target=_flood_main, args=(flood, self.stop, self.out, nice))
        self.process.daemon = True

    def start(self) -> None:
        self.process.start()

    def end(self) -> tuple[list[float], dict[str, dict[str, int]]]:
        """Stop the flood; its token stamps and status counts."""
        self.stop.set()
        stamps, codes = self.out.get(timeout=900)
        self.process.join(30)
        return stamps, codes


# --- memory ---------------------------------------------------------------------------------


def kv_pool_bytes(target: Target) -> int:
    """The model's KV pool as `/v1/node` reports it (reserved at start, written lazily)."""
    with _client(target, timeout=30) as c:
        return int(c.get("/v1/node").json()["models"][0]["memory"]["kv_cache_bytes"])


def preemptions(target: Target) -> int:
    """Sequences the model sent back to prefill so far (`/v1/node`): KV shortages, and the
    streams parked for a lighter tenant's request (service/requests/request_table.py)."""
    with _client(target, timeout=30) as c:
        kv = c.get("/v1/node").json()["models"][0].get("kv_cache") or {}
        return int(kv.get("preemptions", 0))


def memory_mb(pid: int, kv_bytes: int) -> dict[str, int]:
    """The daemon's RSS, and how much of it is the KV pool's pages written so far.

    The pool is one anonymous mapping of `kv_bytes` (torch.empty, engine/model/kv_cache.py),
    reserved at start and committed page by page as blocks are first written. Each tenant's
    cached blocks are bounded (engine/block_pool.py: it reuses its own stale ones before
    fresh pages unless its misses show the cache would have hit), so a flood of distinct
    prompts no longer commits all of it (755 MB for the built-in model at max_batch 8). The
    rest ("outside the KV pool") holds the grammar cache (at most 128 MB) and llguidance's
    tokenizer, built by the first constrained request."""
    kv = 0
    size = rss = 0
    named = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            if not named and kv_bytes <= size <= kv_bytes + (8 << 20):
                kv = max(kv, rss)
            low, high = (int(x, 16) for x in head[0].split("-"))
            size, rss, named = high - low, 0, len(head) == 6
        elif head[0] == "Rss:":
            rss = int(head[1]) * 1024
    if not named and kv_bytes <= size <= kv_bytes + (8 << 20):
        kv = max(kv, rss)
    total = rss_bytes(pid)
    return {"rss": round(total / 1e6), "kv pool written": round(kv / 1e6), "outside kv pool": round((total - kv) / 1e6)}  # fmt: skip


# --- the drill ------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "median_s": round(_pct(values, 0.5), 3),
        "p99_s": round(_pct(values, 0.99), 3),
        "each_s": [round(v, 3) for v in values],
    }


def say(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def phase(calm: Target, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    log = TokenLog()
    say(f"{tag}: first tokens")
    numbers = 1000 if tag == "idle" else 5000  # four digits each, up to 4,000 requests
    out: dict[str, Any] = {"first token": _summary(ttft_series(calm, args.ttft_requests, numbers))}
    say(f"{tag}: small schemas")
    out["small json_schema"] = _summary(small_schemas(calm, args.schemas, tag))
    say(f"{tag}: calm backlogged")
    start, end = backlog(calm, 4, args.seconds, log)
    out["calm tokens/s (4 streams)"] = round(log.rate(start, end), 2)
    out["window"] = (start, end)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"command": " ".join(sys.argv), "flood client nice": args.flood_nice}
    say("starting the daemon")
    with tenant_daemon(args.max_batch, args.log) as (calm, flood_target, config, kv_port):
        assert calm.pid is not None
        kv_bytes = kv_pool_bytes(calm)
        report["kv pool reserved MB"] = round(kv_bytes / 1e6)
        report["memory MB"] = memory = {"start": memory_mb(calm.pid, kv_bytes)}
        health = HealthProbe(calm)
        prober = threading.Thread(target=health.run, daemon=True)
        prober.start()
        say("probes")
        report["stored responses"] = probe_stored_responses(calm, flood_target)
        report["prefix cache"] = probe_prefix_cache(calm, flood_target)
        report["kv events"] = probe_kv_events(calm.pid, kv_port, config)
        report["idle"] = idle = phase(calm, args, "idle")
        memory["before flood"] = memory_mb(calm.pid, kv_bytes)
        before = preemptions(calm)
        kinds = tuple(k for k in args.flood.split(",") if k)
        flood = FloodProcess(
            Flood(flood_target, args.flood_streams, args.flood_tokens, kinds), args.flood_nice
        )
        flood.start()
        time.sleep(5)  # the flood fills the slots and the compile queue
        report["flood"] = under = phase(calm, args, "flood")
        report["preemptions under flood (parks + KV)"] = preemptions(calm) - before
        start, end = under.pop("window")
        idle.pop("window")
        say("flood: stopping")
        stamps, codes = flood.end()
        report["flood tokens/s"] = round(TokenLog(stamps).rate(start, end), 2)
        report["flood statuses"] = codes
        memory["end"] = memory_mb(calm.pid, kv_bytes)
        health.stop.set()
        prober.join(10)
        report["health"] = {"max_s": round(max(health.latencies, default=0), 3), "over 1 s or failed": health.failures, "probes": len(health.latencies)}  # fmt: skip
    return _judge(report)


def log_warnings(path: Path) -> dict[str, int]:
    """The daemon's WARNING and ERROR lines, counted by their logger and first words."""
    counts: dict[str, int] = {}
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split(" ", 4)
        if len(parts) == 5 and parts[2] in ("WARNING", "ERROR"):
            key = f"{parts[2]} {parts[3]} {' '.join(parts[4].split()[:4])}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def _judge(report: dict[str, Any]) -> dict[str, Any]:
    idle, under, memory = report["idle"], report["flood"], report["memory MB"]
    calm_rate = under["calm tokens/s (4 streams)"]
    fair = (calm_rate + report["flood tokens/s"]) / 2
    report["verdict"] = {
        "first token median x idle": round(under["first token"]["median_s"] / idle["first token"]["median_s"], 2),
        "first token p99 x idle": round(under["first token"]["p99_s"] / idle["first token"]["p99_s"], 2),
        "calm tokens/s / fair share": round(calm_rate / fair, 2) if fair else None,
        "rss growth MB": memory["end"]["rss"] - memory["start"]["rss"],
        "rss growth outside the kv pool MB": memory["end"]["outside kv pool"] - memory["start"]["outside kv pool"],
        "health max s": report["health"]["max_s"],
        "isolation closed": all(report[k]["closed"] for k in ("stored responses", "prefix cache", "kv events")),
    }  # fmt: skip
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood-streams", type=int, default=16)
    parser.add_argument("--flood-tokens", type=int, default=128, help="max_tokens of each")
    parser.add_argument(
        "--flood",
        default=",".join(FLOOD_KINDS),
        help="what the flood adds to its long streams: any of schemas,patterns,resets",
    )
    parser.add_argument(
        "--flood-nice",
        type=int,
        default=10,
        help="the flood client's CPU priority (it stands for other machines; 0: the node's own)",
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="each throughput window")
    parser.add_argument("--ttft-requests", type=int, default=20)
    parser.add_argument("--schemas", type=int, default=5, help="small json_schema requests")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--log", type=Path, default=Path("/tmp/tenancy_drill_neuron.log"))
    args = parser.parse_args()
    # SIGTERM (timeout, kill) unwinds like Ctrl-C: the daemon is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args)
    report["daemon warnings"] = log_warnings(args.log)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
