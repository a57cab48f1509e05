"""A JSON body decoded into a msgspec Struct, or a 400 that names the field at fault.

msgspec says where a body is wrong ("... - at `$.messages[0].role`"); `decode_struct` turns
that into a RequestError whose `param` is the field (`messages[0].role`), and lists every
unknown top-level field at once.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from neuron_trio.errors import RequestError

S = TypeVar("S", bound=msgspec.Struct)

_AT_RE = re.compile(r"^(?P<detail>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_UNKNOWN_RE = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$")
_MISSING_RE = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _validation_error(
    exc: msgspec.ValidationError, body: bytes, cls: type[msgspec.Struct]
) -> RequestError:
    """Turn msgspec's "… - at `$.a[0].b`" into a RequestError naming `a[0].b`."""
    text = str(exc)
    match = _AT_RE.match(text)
    detail, path = (match["detail"], match["path"].removeprefix(".")) if match else (text, "")
    unknown = _UNKNOWN_RE.match(detail)
    if unknown:
        names = [_join(path, unknown["name"])]
        if not path:
            names = _all_unknown_fields(body, cls) or names
        joined = ", ".join(names)
        return RequestError(
            f"unsupported field(s): {joined}", param=names[0], code="unsupported_field"
        )
    missing = _MISSING_RE.match(detail)
    if missing:
        name = _join(path, missing["name"])
        return RequestError(f"{name}: required field is missing", param=name, code="missing_field")
    if not path:
        return RequestError(f"request body: {detail}", code="invalid_body")
    return RequestError(f"{path}: {detail}", param=path, code="invalid_value")


def _all_unknown_fields(body: bytes, cls: type[msgspec.Struct]) -> list[str]:
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return []
    if not isinstance(data, dict):
        return []
    return sorted(set(data) - set(cls.__struct_fields__))


def decode_struct(body: bytes, cls: type[S]) -> S:
    """Decode a JSON body into `cls`; RequestError (400) names the field that is wrong."""
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc, body, cls) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec's own depth limit, e.g. in a field nobody reads
        raise RequestError("request body is nested too deeply", code="invalid_json") from None
