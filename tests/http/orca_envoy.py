"""A reimplementation of Envoy's ORCA header parser, to read neuron's header as Envoy would.

Follows source/common/orca/orca_parser.cc (`parseOrcaLoadReportHeaders`) and the helpers it
calls, rule for rule, with Envoy's error messages:

- `endpoint-load-metrics-bin` (base64 protobuf) wins over `endpoint-load-metrics`; of the
  latter only the first value counts. No header: NotFound.
- The value starts with a format prefix: `BIN `, `TEXT ` or `JSON ` (case and the one space
  matter); otherwise "unsupported ORCA header format: P", P being the first five characters
  cut at the first space.
- TEXT: `HeaderUtility::parseCommaDelimitedHeader` (split on ",", each piece stripped of ASCII
  whitespace, empty pieces dropped); each piece split at its first ":" keeping only pieces
  that are not empty or blank (`absl::SkipWhitespace`); a name seen twice: AlreadyExists;
  empty name or value: an error; the value read by `absl::SimpleAtod` (surrounding blanks,
  a sign, decimal or exponent notation, "inf"/"nan" in any case), NaN and infinities refused;
  `named_metrics.NAME` fills the named_metrics map (NAME not empty); `cpu_utilization`,
  `mem_utilization`, `application_utilization`, `eps`, `rps_fractional` their fields; any
  other name: "unsupported metric name".
- JSON: the protobuf JSON mapping of xds.data.orca.v3.OrcaLoadReport (field names as in the
  .proto or lowerCamelCase; doubles as numbers or numeric strings; maps as objects of
  doubles); an unknown field or malformed JSON is an error.
- BIN is not needed by neuron (it never sends it) and is not reimplemented.

Its own tests (test_orca.py) run it over the vectors of Envoy's test/common/orca/
orca_parser_test.cc first, so a drift from Envoy shows there.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

HEADER = "endpoint-load-metrics"
HEADER_BIN = "endpoint-load-metrics-bin"
_FIELDS = ("cpu_utilization", "mem_utilization", "application_utilization", "eps", "rps_fractional")
_MAPS = ("named_metrics", "utilization", "request_cost")
_JSON_ONLY = ("rps",)  # deprecated uint64
# absl::SimpleAtod: std::from_chars general format after an optional sign, blanks around.
_ATOD = re.compile(
    r"^[ \t\n\v\f\r]*[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)[ \t\n\v\f\r]*$",
    re.IGNORECASE,
)


class OrcaError(Exception):
    """Raised by `parse_orca_headers` with Envoy's status kind and message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


@dataclass
class OrcaLoadReport:
    cpu_utilization: float = 0.0
    mem_utilization: float = 0.0
    application_utilization: float = 0.0
    eps: float = 0.0
    rps_fractional: float = 0.0
    rps: int = 0
    named_metrics: dict[str, float] = field(default_factory=dict)
    utilization: dict[str, float] = field(default_factory=dict)
    request_cost: dict[str, float] = field(default_factory=dict)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _simple_atod(text: str) -> float | None:
    if not _ATOD.match(text):
        return None
    return float(text.strip())


def _parse_comma_delimited(value: str) -> list[str]:
    tokens = (piece.strip(" \t\n\v\f\r") for piece in value.split(","))
    return [token for token in tokens if token]


def _copy_metric(name: str, value: str, report: OrcaLoadReport) -> None:
    if not name:
        raise OrcaError("InvalidArgument", "metric names cannot be empty strings")
    if not value:
        raise OrcaError("InvalidArgument", "metric values cannot be empty strings")
    number = _simple_atod(value)
    if number is None:
        raise OrcaError(
            "InvalidArgument", f"unable to parse custom backend load metric value({name}): {value}"
        )
    if math.isnan(number):
        raise OrcaError(
            "InvalidArgument", f"custom backend load metric value({name}) cannot be NaN."
        )
    if math.isinf(number):
        raise OrcaError(
            "InvalidArgument", f"custom backend load metric value({name}) cannot be infinity."
        )
    if name.startswith("named_metrics."):
        key = name.removeprefix("named_metrics.")
        if not key:
            raise OrcaError("InvalidArgument", "named metric key is empty.")
        report.named_metrics.setdefault(key, number)  # protobuf Map::insert keeps the first
        return
    if name in _FIELDS:
        setattr(report, name, number)
        return
    raise OrcaError("InvalidArgument", f"unsupported metric name: {name}")


def _parse_text(value: str, report: OrcaLoadReport) -> None:
    seen: set[str] = set()
    for piece in _parse_comma_delimited(value):
        parts = [p for p in piece.split(":", 1) if p.strip(" \t\n\v\f\r")]
        name = parts[0] if parts else ""
        metric = parts[1] if len(parts) > 1 else ""
        if name in seen:
            raise OrcaError("AlreadyExists", f"{HEADER} contains duplicate metric: {name}")
        _copy_metric(name, metric, report)
        seen.add(name)


def _json_double(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a double")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        if value in ("NaN", "Infinity", "-Infinity"):
            return float(value.replace("Infinity", "inf"))
        return float(value)  # ValueError if not numeric
    raise ValueError(f"{value!r} is not a double")


def _parse_json(value: str, report: OrcaLoadReport) -> None:
    names = {n: n for n in (*_FIELDS, *_MAPS, *_JSON_ONLY)}
    names |= {_camel(n): n for n in list(names)}
    try:
        doc = json.loads(value)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        for key, item in doc.items():
            name = names.get(key)
            if name is None:
                raise ValueError(f"unknown field {key}")
            if name in _MAPS:
                if not isinstance(item, dict):
                    raise ValueError(f"{key} is not an object")
                setattr(report, name, {str(k): _json_double(v) for k, v in item.items()})
            elif name == "rps":
                report.rps = int(item)
            else:
                setattr(report, name, _json_double(item))
    except (ValueError, TypeError) as exc:
        raise OrcaError("InvalidArgument", f"invalid JSON: {exc}") from None


def parse_orca_headers(headers: list[tuple[str, str]]) -> OrcaLoadReport:
    """Envoy's `parseOrcaLoadReportHeaders` over `headers` (lower-case names, in order)."""
    report = OrcaLoadReport()
    binary = [v for k, v in headers if k == HEADER_BIN]
    text = [v for k, v in headers if k == HEADER]
    if binary:
        raise NotImplementedError("the binary format is not reimplemented")
    if not text:
        raise OrcaError("NotFound", "no ORCA data sent from the backend")
    value = text[0]
    if value.startswith("BIN "):
        raise NotImplementedError("the binary format is not reimplemented")
    if value.startswith("TEXT "):
        _parse_text(value.removeprefix("TEXT "), report)
    elif value.startswith("JSON "):
        _parse_json(value.removeprefix("JSON "), report)
    else:
        prefix = value[:5]
        prefix = prefix.split(" ", 1)[0]
        raise OrcaError("InvalidArgument", f"unsupported ORCA header format: {prefix}")
    return report
