"""The one way neuron writes an instant: RFC 3339, UTC, milliseconds, `Z`."""

from __future__ import annotations

from datetime import UTC, datetime


def utc_iso(ts: float | datetime) -> str:
    """`2026-12-03T04:33:57.123Z` for unix seconds (time.time()) or an aware datetime."""
    moment = ts if isinstance(ts, datetime) else datetime.fromtimestamp(ts, UTC)
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
