"""JSON Schemas as clients write them, made ready for the grammar compiler.

Three things clients send that llguidance does not take as they are:

- OpenAI's `strict: true` closes objects: with it, an object schema without
  `additionalProperties` admits no other keys (`close_objects`). A tool call the request
  demands closes the objects that list their properties, strict or not.
- A tool's parameters are compiled inside a wrapper object (`{"name": ..., "arguments":
  {parameters}}`), so a local reference such as pydantic's `{"$ref": "#/$defs/Address"}`
  must point into the wrapper (`rebase_refs`); otherwise the compiler looks for `$defs` at the
  wrapper's root and fails (issue 26: `openai.pydantic_function_tool` with a nested model).
- A reference outside the document (`"$ref": "https://..."`) cannot be fetched: a 400 naming
  it, in one line (`rebase_refs` and `refuse_remote_refs`).

Every walk here is iterative: schemas arrive bounded by `schema_limits.check_schema`, but a
walk that recursed would still be the one place a deep schema could overflow Python's stack.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from neuron_trio.errors import RequestError

__all__ = ["close_objects", "one_line", "rebase_refs", "refuse_remote_refs"]

# Keywords whose values are data, not schemas: never walked for `$ref` or `properties`.
_DATA = frozenset(
    {"const", "enum", "default", "examples", "description", "title", "$comment", "required"}
)
# Keywords whose values map names to schemas.
_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})


def _schemas(root: Any) -> Iterator[dict[str, Any]]:
    """Every (sub)schema object in `root`, depth first."""
    stack: list[Any] = [root]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
            continue
        if not isinstance(value, dict):
            continue
        yield value
        for key, item in value.items():
            if key in _DATA:
                continue
            if key in _MAPS and isinstance(item, dict):
                stack.extend(item.values())
            else:
                stack.append(item)


def close_objects(schema: Any, *, listed_only: bool = False) -> None:
    """OpenAI's strict mode, in place: every object schema that does not say otherwise gets
    `additionalProperties: false`. With `listed_only`, only objects that list their
    `properties` (an empty list included): a bare `{"type": "object"}` is a free-form
    dictionary and stays one."""
    for node in _schemas(schema):
        kind = node.get("type")
        is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
        if listed_only and "properties" not in node:
            continue
        if (is_object or "properties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False


def refuse_remote_refs(schema: Any, *, param: str) -> None:
    """RequestError naming `param` if `schema` has a `$ref` outside the document."""
    for node in _schemas(schema):
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
            raise RequestError(
                f"{param}: $ref {_clip(ref)!s} is not supported: only references inside the "
                "schema (#/$defs/...) are",
                param=param,
                code="invalid_schema",
            )


def rebase_refs(schema: Any, pointer: str, *, param: str) -> None:
    """In place: every local `$ref` in `schema` ("#/$defs/X", "#") made relative to the
    document in which `schema` will sit at JSON pointer `pointer` ("/properties/arguments").
    RequestError naming `param` for a reference outside the document."""
    refuse_remote_refs(schema, param=param)
    for node in _schemas(schema):
        ref = node.get("$ref")
        if isinstance(ref, str):
            node["$ref"] = "#" + pointer + ref[1:]


def one_line(error: str, limit: int = 300) -> str:
    """The compiler's message as one line: its first line, without the grammar dump, the
    Rust backtrace or the parser state that llguidance appends (issue 26: never a dump)."""
    first = next((line.strip() for line in error.splitlines() if line.strip()), "")
    for marker in ("<backtrace>", "stack backtrace:", " 1 | "):
        first = first.split(marker, 1)[0].strip()
    first = first.removeprefix("panic: ")
    return _clip(first, limit) or "the grammar is invalid"


def _clip(value: object, limit: int = 80) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
