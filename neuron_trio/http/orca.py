"""ORCA load reports in response headers, for proxies that balance by backend load (Envoy).

A request that carries `endpoint-load-metrics-format: text` (or `json`) gets its response with
an `endpoint-load-metrics` header holding the load of the model it asked for (the node's when
it named none, or one not loaded), in the native HTTP format Envoy's ORCA parser reads
(source/common/orca/orca_parser.cc):

    endpoint-load-metrics: TEXT application_utilization:0.5,named_metrics.kv_cache_usage_perc:0.25,named_metrics.num_requests_waiting:0,named_metrics.num_requests_running:2
    endpoint-load-metrics: JSON {"application_utilization":0.5,"named_metrics":{"kv_cache_usage_perc":0.25,...}}

The figures are `service.documents.load_report.LoadReport`'s, taken when the response starts (for a
stream: when its first byte goes out). Without the request header nothing is added; `bin`
(a serialized protobuf) is not offered.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuron_trio.http.access_log import access_info
from neuron_trio.service.api import LoadReport

__all__ = ["FORMAT_HEADER", "REPORT_HEADER", "OrcaLoadReports", "orca_header_value"]

FORMAT_HEADER = b"endpoint-load-metrics-format"
REPORT_HEADER = b"endpoint-load-metrics"
FORMATS = ("text", "json")


class _OrcaReport(msgspec.Struct):
    """The subset of xds.data.orca.v3.OrcaLoadReport neuron fills, in its JSON field names."""

    application_utilization: float
    named_metrics: dict[str, float]


def _named_metrics(report: LoadReport) -> dict[str, float]:
    return {
        "kv_cache_usage_perc": report.kv_cache_usage_perc,
        "num_requests_waiting": report.num_requests_waiting,
        "num_requests_running": report.num_requests_running,
    }


def _number(value: float) -> str:
    # repr: the shortest text that reads back as the same double (no locale, no "nan": the
    # figures are finite by construction).
    return repr(value) if isinstance(value, float) else str(int(value))


def orca_header_value(report: LoadReport, fmt: str) -> str:
    """The `endpoint-load-metrics` value for `fmt` ("text" or "json")."""
    named = _named_metrics(report)
    if fmt == "json":
        doc = _OrcaReport(report.application_utilization, named)
        return "JSON " + msgspec.json.encode(doc).decode()
    pairs = [f"application_utilization:{_number(report.application_utilization)}"]
    pairs += [f"named_metrics.{name}:{_number(value)}" for name, value in named.items()]
    return "TEXT " + ",".join(pairs)


def _requested_format(scope: Scope) -> str | None:
    for key, value in scope["headers"]:
        if key == FORMAT_HEADER:
            fmt = bytes(value).strip().lower().decode("latin-1")
            return fmt if fmt in FORMATS else None
    return None


class OrcaLoadReports:
    """ASGI: adds the ORCA header to responses whose request asked for one. Sits inside
    `NeuronMiddleware`, whose access info names the request's model once it is parsed."""

    def __init__(self, app: ASGIApp, load: Callable[[str | None], LoadReport]) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fmt = _requested_format(scope) if scope["type"] == "http" else None
        if fmt is None:
            await self.app(scope, receive, send)
            return

        async def send_with_report(message: Message) -> None:
            if message["type"] == "http.response.start":
                access = access_info(scope)
                value = orca_header_value(self.load(access.model if access else None), fmt)
                headers = [*message.get("headers", ()), (REPORT_HEADER, value.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_report)
