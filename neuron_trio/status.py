"""`neuron status`: one screen for a person at the node, from `/v1/node` and `/metrics`.

Reads the daemon over HTTP/1.1 with the standard library (no client dependency for a command
an operator runs on the node), with the first key of `server.api_key_file` when the config
sets one. Exit 0 only when the node is serving (`status` ok); 69 (EX_UNAVAILABLE) when it is
starting, draining, recovering, wedged, or cannot be reached.
"""

from __future__ import annotations

import ipaddress
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from neuron_trio.config import NeuronConfig, parse_listen
from neuron_trio.errors import EX_OK, EX_UNAVAILABLE

TIMEOUT_S = 10.0  # /v1/node reads NVML live, bounded by its own timeout (5 s)


class StatusError(Exception):
    """Raised by `fetch_status` if the daemon cannot be reached or answers an error."""


@dataclass(frozen=True)
class NodeStatus:
    node: dict[str, Any]  # the /v1/node document
    metrics: dict[str, float]  # '<sample name>{k="v",...}' -> value, for the series used here

    @property
    def serving(self) -> bool:
        return self.node.get("status") == "ok"

    def exit_code(self) -> int:
        return EX_OK if self.serving else EX_UNAVAILABLE


def default_url(config: NeuronConfig) -> str:
    """The first `server.listen` address as a URL; a wildcard address is asked on loopback."""
    host, port = parse_listen(config.server.listen[0])
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.is_unspecified:
        host = "::1" if ip.version == 6 else "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if config.server.tls_cert else "http"
    return f"{scheme}://{host}:{port}"


def api_key(config: NeuronConfig) -> str | None:
    """The first key in `server.api_key_file` (None when unset). Raises ConfigError."""
    from neuron_trio.http.app import read_api_keys  # the daemon's own reading of the file

    keys = read_api_keys(config.server.api_key_file)
    return keys[0].decode() if keys else None


def _tls_context(config: NeuronConfig | None) -> ssl.SSLContext:
    # The node's own certificate is trusted (often self-signed); a status read asks the local
    # daemon by address, which the certificate usually does not name.
    context = ssl.create_default_context()
    if config is not None and config.server.tls_cert:
        context.load_verify_locations(cafile=config.server.tls_cert)
        context.check_hostname = False
    return context


def _get(url: str, key: str | None, context: ssl.SSLContext | None) -> bytes:
    request = urllib.request.Request(url, headers={"accept": "application/json, text/plain"})
    if key:
        request.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode("utf-8", "replace")
        hint = " (is server.api_key_file in --config the node's?)" if exc.code == 401 else ""
        raise StatusError(f"{url}: HTTP {exc.code}{hint}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusError(f"{url}: cannot connect: {reason}") from None


# The series `neuron status` reads from /metrics (everything else comes from /v1/node).
_WANTED = (
    "neuron_model_requests_total",
    "neuron_watchdog_wedges_total",
    "neuron_watchdog_aborts_total",
    "neuron_watchdog_recoveries_total",
    "neuron_watchdog_idle_probes_total",
    "neuron_gpu_memory_used_bytes",
    "neuron_gpu_memory_total_bytes",
    "neuron_gpu_utilization_ratio",
)


def parse_metrics(text: str, wanted: Iterable[str] = _WANTED) -> dict[str, float]:
    names = set(wanted)
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                found[f"{s.name}{{{labels}}}"] = s.value
    return found


def fetch_status(url: str, *, key: str | None, config: NeuronConfig | None = None) -> NodeStatus:
    """Read `/v1/node` and `/metrics` of the daemon at `url`. Raises StatusError."""
    base = url.rstrip("/")
    context = _tls_context(config) if base.startswith("https:") else None
    raw = _get(base + "/v1/node", key, context)
    try:
        node = json.loads(raw)
    except ValueError:
        raise StatusError(f"{base}/v1/node: not JSON: {raw[:200]!r}") from None
    metrics = parse_metrics(_get(base + "/metrics", key, context).decode("utf-8", "replace"))
    return NodeStatus(node=node, metrics=metrics)


# --- the screen -------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


def _uptime(started_at: str | None, now: float) -> str:
    if not started_at:
        return "?"
    try:
        started = datetime.fromisoformat(started_at).timestamp()
    except ValueError:
        return "?"
    return _duration(now - started)


def _sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v
        for key, v in metrics.items()
        if key.startswith(name + "{") and all(w in key for w in wanted)
    )


def _model_lines(model: dict[str, Any], metrics: dict[str, float], rate: Any) -> list[str]:
    name = str(model.get("name"))
    tokens = f"{rate:.1f} tok/s (1 min)" if isinstance(rate, int | float) else "- tok/s (1 min)"
    devices = ",".join(str(d) for d in model.get("devices") or []) or "?"
    lines = [
        f"  {name:<20} {model.get('state', '?'):<10} tp {model.get('tp', '?')} on {devices}, "
        f"weights {model.get('weights') or model.get('dtype') or '?'}",
        f"    slots {model.get('slots_in_use', '?')}/{model.get('slots_total', '?')}"
        f"   queue {model.get('queued', '?')}/{model.get('max_queue', '?')}   {tokens}",
    ]
    kv = model.get("kv_cache")
    if isinstance(kv, dict):  # a node older than the paged KV cache has none
        queries = kv.get("prefix_cache_queries_tokens") or 0
        hits = (
            f"{100 * (kv.get('prefix_cache_hits_tokens') or 0) / queries:.0f}%" if queries else "-"
        )
        lines.append(
            f"    kv blocks {kv.get('blocks_used', '?')}/{kv.get('blocks_total', '?')}"
            f" (+{kv.get('blocks_cached', '?')} cached)   prefix hits {hits}"
            f"   preemptions {kv.get('preemptions', '?')}"
        )
    served = _sum(metrics, "neuron_model_requests_total", model=name)
    rejected = _sum(
        metrics, "neuron_model_requests_total", model=name, outcome="rejected_queue_full"
    )
    unavailable = _sum(metrics, "neuron_model_requests_total", model=name, outcome="unavailable")
    lines.append(
        f"    requests {served:.0f} (429 {rejected:.0f}, failed in flight {unavailable:.0f})"
        f"   steps {model.get('steps', '?')}, failed {model.get('step_failures', '?')}"
    )
    wd = model.get("watchdog") or {}
    if wd:
        aborts = wd.get("aborts") or {}
        abort_text = ", ".join(f"{k} {v}" for k, v in aborts.items()) or "none"
        lines.append(
            f"    watchdog {wd.get('state', '?')}: wedges {wd.get('wedges', 0)}, "
            f"aborts ({abort_text}), recoveries {wd.get('recoveries', 0)}, "
            f"probes {wd.get('probes', 0)}"
        )
        last = wd.get("last_wedge")
        if last:
            abort = (
                f", abort {last['abort']} after {last.get('abort_s', '?')} s"
                if last.get("abort")
                else ""
            )
            lines.append(f"    last wedge: {last.get('what')} at {last.get('at')}{abort}")
    if model.get("last_error"):
        lines.append(f"    last error: {model['last_error']}")
    return lines


def _gpu_lines(node: dict[str, Any]) -> list[str]:
    gpus = node.get("gpus") or {}
    if not gpus.get("available"):
        return [f"gpus      none ({gpus.get('reason') or gpus.get('error') or 'no NVML'})"]
    lines = []
    gib = float(1 << 30)
    for g in gpus.get("gpus") or []:
        if g.get("error"):
            lines.append(f"gpu {g.get('index')}     {g['error']}")
            continue
        util = g.get("utilization_gpu_pct")
        lines.append(
            f"gpu {g.get('index')}     {g.get('name')}: "
            f"{(g.get('memory_used_bytes') or 0) / gib:.1f}/{(g.get('memory_total_bytes') or 0) / gib:.1f} GiB"
            + (f", util {util}%" if util is not None else "")
        )
    return lines


def _forensics_lines(node: dict[str, Any]) -> list[str]:
    last = node.get("last_forensics")
    if not last:
        return ["forensics none (no deadman exit recorded in the state directory)"]
    report = last.get("report") or {}
    if "unreadable" in report:
        return [f"forensics {last.get('path')}: unreadable ({report['unreadable']})"]
    return [
        f"forensics {report.get('at', '?')}: {report.get('reason', '?')}: {report.get('what', '?')}"
        f" wedged for {report.get('wedged_for_s', '?')} s, "
        f"{report.get('inflight_count', '?')} requests in flight",
        f"          {last.get('path')}",
    ]


def render(status: NodeStatus, *, url: str, now: float | None = None) -> str:
    """The human screen (plain text, about 80 columns)."""
    node = status.node
    now = time.time() if now is None else now
    wd = node.get("watchdog") or {}
    verdict = "SERVING" if status.serving else f"NOT SERVING ({node.get('status')})"
    lines = [
        f"neuron on {node.get('hostname', '?')} ({url}): {verdict}",
        f"boot      {node.get('boot_id', '?')}, start {node.get('starts', '?')} in this state "
        f"dir, up {_uptime(node.get('started_at'), now)} (since {node.get('started_at', '?')})"
        + (
            "; the process before did NOT stop cleanly"
            if node.get("previous_stop_clean") is False
            else ""
        ),
        f"watchdog  step timeout {wd.get('step_timeout_s', '?')} s, abort deadline "
        f"{wd.get('abort_deadline_s', '?')} s, probe every {wd.get('probe_interval_s', '?')} s"
        + (f"; DEADMAN FIRING: {wd.get('deadman_reason')}" if wd.get("deadman_firing") else ""),
        *_gpu_lines(node),
        *_forensics_lines(node),
    ]
    failpoints = node.get("failpoints") or {}
    if failpoints.get("configured") or failpoints.get("fired"):
        lines.append(
            f"FAILPOINTS {json.dumps(failpoints.get('configured') or {})}, fired "
            f"{json.dumps(failpoints.get('fired') or [])} (fault injection: never in production)"
        )
    models = node.get("models") or []
    lines.append(f"models    {len(models)}")
    rates = node.get("generated_tokens_per_s_1m") or {}
    for model in models:
        lines.extend(_model_lines(model, status.metrics, rates.get(model.get("name"))))
    return "\n".join(lines) + "\n"


def as_json(status: NodeStatus, *, url: str) -> str:
    """`--json`: one document, the /v1/node one plus `url`, `serving` and the metrics read."""
    return (
        json.dumps(
            {"url": url, "serving": status.serving, "node": status.node, "metrics": status.metrics},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
