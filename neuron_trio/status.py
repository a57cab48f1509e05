"""`neuron status`: one screen for a person at the node, from `/v1/node` and `/metrics`.

Reads the daemon over HTTP/1.1 with the standard library (no client dependency for a command
an operator runs on the node), with the admin key, or the first API key, when the config sets
one (`api_key`), and decodes `/v1/node` into the node's own types (`service/documents/node_document.py`). Exit 0 only when the node is serving (`status` ok); 69 (EX_UNAVAILABLE) when it is
starting, draining, recovering, wedged, or cannot be reached.
"""

from __future__ import annotations

import ipaddress
import json
import re
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from neuron_trio.config import NeuronConfig, parse_listen
from neuron_trio.errors import EX_OK, EX_UNAVAILABLE, ConfigError
from neuron_trio.service.documents.node_document import LastForensics, ModelInfo, NodeInfo

TIMEOUT_S = 10.0  # /v1/node reads NVML live, bounded by its own timeout (5 s)


class StatusError(Exception):
    """Raised by `fetch_status` if the daemon cannot be reached or answers an error."""


@dataclass(frozen=True)
class NodeStatus:
    node: dict[str, Any]  # the /v1/node document as it came (`--json` shows it so)
    metrics: dict[str, float]  # '<sample name>{k="v",...}' -> value, for the series used here

    @cached_property
    def document(self) -> NodeInfo:
        """The document decoded into its types; msgspec.ValidationError if it is not one."""
        return msgspec.convert(self.node, NodeInfo)

    @property
    def serving(self) -> bool:
        return self.document.status == "ok"

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
    """The key to ask with: the first of `server.admin_key_file` when it is set and readable
    (an operator's: /metrics, with the per-tenant figures, needs one then), else the first of
    `server.api_key_file`, else of the first tenant's `keys_file`; None without any. Raises
    ConfigError if the file it falls back to cannot be read."""
    from neuron_trio.http.tenancy import read_api_keys  # the daemon's own reading of the file

    if config.server.admin_key_file is not None:
        try:
            return read_api_keys(config.server.admin_key_file, "server.admin_key_file")[0].decode()
        except ConfigError:
            pass  # not readable by this user: a tenant's key still reads /v1/node
    keys = read_api_keys(config.server.api_key_file)
    for i, tenant in enumerate(config.tenants):
        if keys:
            break
        keys = read_api_keys(tenant.keys_file, f"tenants[{i}].keys_file")
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
    "neuron_tenant_requests_total",
    "neuron_tenant_rejections_total",
    "neuron_tenant_prompt_tokens_total",
    "neuron_tenant_completion_tokens_total",
    "neuron_tenant_queue_time_seconds_sum",
    "neuron_tenant_queue_time_seconds_count",
)
_TENANT_LABEL = re.compile(r'tenant="([^"]*)"')


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
    status = NodeStatus(node=node, metrics=metrics)
    try:
        status.document  # noqa: B018 (decoded now: a wrong document is a StatusError)
    except msgspec.ValidationError as exc:
        raise StatusError(f"{base}/v1/node: not a node document: {exc}") from None
    return status


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


def _uptime(started_at: str, now: float) -> str:
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


def _model_lines(model: ModelInfo, metrics: dict[str, float], rate: float | None) -> list[str]:
    name = model.name
    tokens = f"{rate:.1f} tok/s (1 min)" if rate is not None else "- tok/s (1 min)"
    devices = ",".join(model.devices) or "?"
    lines = [
        f"  {name:<20} {model.state or '?':<10} tp {model.tp} on {devices}, "
        f"weights {model.weights or model.dtype or '?'}",
        f"    slots {model.slots_in_use}/{model.slots_total}"
        f"   queue {model.queued}/{model.max_queue}   {tokens}",
    ]
    kv = model.kv_cache
    if kv is not None:  # a node older than the paged KV cache has none
        queries = kv.prefix_cache_queries_tokens or 0  # None: hidden from a non-operator
        hits = f"{100 * (kv.prefix_cache_hits_tokens or 0) / queries:.0f}%" if queries else "-"
        lines.append(
            f"    kv blocks {kv.blocks_used}/{kv.blocks_total} (+{kv.blocks_cached} cached)"
            f"   prefix hits {hits}   preemptions {kv.preemptions}"
        )
    served = _sum(metrics, "neuron_model_requests_total", model=name)
    rejected = _sum(
        metrics, "neuron_model_requests_total", model=name, outcome="rejected_queue_full"
    )
    unavailable = _sum(metrics, "neuron_model_requests_total", model=name, outcome="unavailable")
    lines.append(
        f"    requests {served:.0f} (429 {rejected:.0f}, failed in flight {unavailable:.0f})"
        f"   steps {model.steps}, failed {model.step_failures}"
    )
    wd = model.watchdog
    if wd is not None:
        abort_text = ", ".join(f"{k} {v}" for k, v in wd.aborts.items()) or "none"
        lines.append(
            f"    watchdog {wd.state}: wedges {wd.wedges}, aborts ({abort_text}), "
            f"recoveries {wd.recoveries}, probes {wd.probes}"
        )
        last = wd.last_wedge
        if last is not None:
            abort_s = "?" if last.abort_s is msgspec.UNSET else last.abort_s
            abort = f", abort {last.abort} after {abort_s} s" if last.abort else ""
            lines.append(f"    last wedge: {last.what} at {last.at}{abort}")
    if model.last_error:
        lines.append(f"    last error: {model.last_error}")
    return lines


def _gpu_lines(gpus: Any) -> list[str]:
    # The live NVML snapshot (`gpu/nvml.py`, written with its own `to_dict`), as it came.
    gpus = gpus or {}
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


def _forensics_lines(last: LastForensics | str | None) -> list[str]:
    if not last:
        return ["forensics none (no deadman exit recorded in the state directory)"]
    if isinstance(last, str):  # hidden from a caller that is not an operator
        return [f"forensics {last}"]
    # The report as the deadman wrote it (`service/wedge/forensics.py`), or why it is unreadable.
    report = last.report if isinstance(last.report, dict) else {}
    if "unreadable" in report:
        return [f"forensics {last.path}: unreadable ({report['unreadable']})"]
    return [
        f"forensics {report.get('at', '?')}: {report.get('reason', '?')}: {report.get('what', '?')}"
        f" wedged for {report.get('wedged_for_s', '?')} s, "
        f"{report.get('inflight_count', '?')} requests in flight",
        f"          {last.path}",
    ]


def _tenant_lines(metrics: dict[str, float]) -> list[str]:
    """One line per tenant seen in the per-tenant series (issue 47), busiest first."""
    tenants = {
        m[1]
        for key in metrics
        if key.startswith("neuron_tenant_") and (m := _TENANT_LABEL.search(key)) is not None
    }
    if not tenants:
        return []
    rows = []
    for tenant in tenants:
        served = _sum(metrics, "neuron_tenant_requests_total", tenant=tenant)
        rejected = _sum(metrics, "neuron_tenant_rejections_total", tenant=tenant)
        prompt = _sum(metrics, "neuron_tenant_prompt_tokens_total", tenant=tenant)
        completion = _sum(metrics, "neuron_tenant_completion_tokens_total", tenant=tenant)
        waits = _sum(metrics, "neuron_tenant_queue_time_seconds_count", tenant=tenant)
        waited = _sum(metrics, "neuron_tenant_queue_time_seconds_sum", tenant=tenant)
        queue = f"{waited / waits:.2f} s" if waits else "-"
        rows.append(
            (
                -(prompt + completion),
                f"  {tenant:<20} requests {served:.0f} (rejected {rejected:.0f})   tokens "
                f"{prompt:.0f} in, {completion:.0f} out   queue {queue} mean",
            )
        )
    return [f"tenants   {len(tenants)}", *(line for _, line in sorted(rows))]


def render(status: NodeStatus, *, url: str, now: float | None = None) -> str:
    """The human screen (plain text, about 80 columns)."""
    node = status.document
    now = time.time() if now is None else now
    wd = node.watchdog
    verdict = "SERVING" if status.serving else f"NOT SERVING ({node.status})"
    lines = [
        f"neuron on {node.hostname or '?'} ({url}): {verdict}",
        f"boot      {node.boot_id or '?'}, start {node.starts} in this state "
        f"dir, up {_uptime(node.started_at, now)} (since {node.started_at or '?'})"
        + ("; the process before did NOT stop cleanly" if not node.previous_stop_clean else ""),
        f"watchdog  step timeout {wd.step_timeout_s:g} s, abort deadline "
        f"{wd.abort_deadline_s:g} s, probe every {wd.probe_interval_s:g} s"
        + (f"; DEADMAN FIRING: {wd.deadman_reason}" if wd.deadman_firing else ""),
        *_gpu_lines(node.gpus),
        *_forensics_lines(node.last_forensics),
    ]
    failpoints = node.failpoints
    if failpoints.configured or failpoints.fired:
        lines.append(
            f"FAILPOINTS {json.dumps(failpoints.configured)}, fired "
            f"{json.dumps(failpoints.fired)} (fault injection: never in production)"
        )
    lines.append(f"models    {len(node.models)}")
    for model in node.models:
        rate = node.generated_tokens_per_s_1m.get(model.name)
        lines.extend(_model_lines(model, status.metrics, rate))
    lines.extend(_tenant_lines(status.metrics))
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
