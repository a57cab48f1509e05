"""Bounds on a JSON Schema's size and shape, checked before the grammar compiler sees it.

llguidance's compile time and memory grow faster than linearly with some shapes, and one of
them crashes it (issue 25). Measured on the built-in model's 49 152-token vocabulary, a
`const` object of N keys took (compile + first mask):

    N = 1 000:  0.06 s,    12 MB
    N = 13 000: 2.3 s,    640 MB (about 200 KB of schema)
    N = 20 000: a caught Rust panic (more than 65 525 grammar symbols)
    N = 30 000: SIGSEGV, a stack overflow on the default 8 MB thread stack

and 5 000 object properties took 1.8 s. llguidance's own resource limits (`LLParserLimits`)
bound the lexer, not these: the 640 MB came with `max_lexer_states` at 5 000 as at 250 000.
So the shapes that cost are bounded here, on the decoded schema, in one pass that never
recurses (a schema nested deeper than Python's stack is refused, not crashed on). Each
bound is a field of `SchemaLimits`; the error names the field that was exceeded.

The defaults follow OpenAI's published structured-output limits where it has one (1 000
enum values in a schema; it allows 5 000 properties, neuron 1 000 because compile time grows
faster than linearly: 2 000 optional properties took 0.7-1.0 s) and keep every compile under
about half a second on two cores. At the bounds, the costliest shapes measured (compile and
first mask, in a thread of the given stack size):

    shape                          time     RSS     stack: 0.25 MB   1 MB
    const object of 1 999 keys     0.36 s   35 MB   SIGSEGV          ok
    2 000 optional properties      0.73 s   24 MB   SIGSEGV          ok
    anyOf of 600 objects           0.25 s   22 MB   ok               ok
    arrays nested 46 deep          0.00 s    3 MB   ok               ok

so a compile within the bounds needs under 1 MB of stack: the compile threads'
(`compile_threads.COMPILE_STACK_BYTES`) and the default 8 MB both leave a wide margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuron_trio.errors import RequestError

__all__ = [
    "DEFAULT_LIMITS",
    "SchemaLimits",
    "SchemaSize",
    "SchemaTooComplexError",
    "check_schema",
    "check_size",
]

# Keys whose values are annotations: llguidance never compiles them into the grammar, so
# they count towards `max_bytes` only (descriptions may be long; they cost no compile).
_ANNOTATIONS = frozenset({"description", "title", "$comment", "examples", "default", "deprecated"})
# Keys whose values are JSON data matched literally (not schemas): their size drives the
# quadratic cost measured above.
_LITERALS = frozenset({"const", "enum"})


@dataclass(frozen=True)
class SchemaLimits:
    """What one constraint's schemas (a response format, or all tools' parameters of one
    request together) may hold."""

    max_bytes: int = 128 * 1024  # the schema as compact JSON text
    max_nodes: int = 10_000  # JSON values (objects, arrays, strings, numbers, ...) in it
    max_depth: int = 48  # nesting of JSON values
    max_properties: int = 1_000  # property names, over all objects
    max_enum_values: int = 1_000  # values of all `enum`s together (OpenAI's limit)
    max_literal_nodes: int = 2_000  # JSON values inside `const` and `enum` values, together
    max_string_chars: int = 4_096  # one string that is compiled (a pattern, a key, a const)


DEFAULT_LIMITS = SchemaLimits()


class SchemaTooComplexError(RequestError):
    """Raised by `check_schema` if a schema exceeds one of its `SchemaLimits` (a 400)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message, param=param, code="schema_too_complex")


@dataclass
class SchemaSize:
    """What `check_schema` counted: the measures of a schema that its compiled grammar's
    memory follows (`estimated_bytes`)."""

    nodes: int = 0
    properties: int = 0
    enum_values: int = 0
    literal_nodes: int = 0

    def __add__(self, other: SchemaSize) -> SchemaSize:
        return SchemaSize(
            self.nodes + other.nodes,
            self.properties + other.properties,
            self.enum_values + other.enum_values,
            self.literal_nodes + other.literal_nodes,
        )

    def estimated_bytes(self) -> int:
        """An upper estimate of the memory a compiled grammar of this schema holds, fitted
        to the measurements above (35 MB for 2 000 const values, 24 MB for 2 000
        properties, 3 MB for a small schema), with room for the lexer states that masks
        add as sequences use it."""
        mib, kib = 1 << 20, 1 << 10
        return (
            4 * mib
            + 18 * kib * self.literal_nodes
            + 12 * kib * self.properties
            + (kib * self.nodes)
        )


# What a JSON value is to the walk: a schema (its keys are keywords), a map of names to
# schemas (`properties`, `$defs`: every key is a name, never an annotation), or literal data.
_SCHEMA, _MAP, _LITERAL = 0, 1, 2
_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})


def check_size(size: int, *, param: str, limits: SchemaLimits = DEFAULT_LIMITS) -> None:
    """SchemaTooComplexError naming `param` if a schema of `size` bytes of JSON text is over
    `limits.max_bytes`: checked before the text is even decoded."""
    if size > limits.max_bytes:
        raise SchemaTooComplexError(
            f"{param}: the schema is too complex for structured output: its JSON text has "
            f"bytes: {size}, more than the limit of {limits.max_bytes} (SchemaLimits.max_bytes)",
            param=param,
        )


def check_schema(
    schema: Any, *, param: str, size: int, limits: SchemaLimits = DEFAULT_LIMITS
) -> SchemaSize:
    """What `schema` (decoded JSON, `size` bytes as text) holds; SchemaTooComplexError naming
    `param` and the bound if it exceeds `limits`. Linear in its size; never recurses."""

    def refuse(what: str, value: int, field: str) -> SchemaTooComplexError:
        bound = getattr(limits, field)
        return SchemaTooComplexError(
            f"{param}: the schema is too complex for structured output: {what} {value}, "
            f"more than the limit of {bound} (SchemaLimits.{field})",
            param=param,
        )

    check_size(size, param=param, limits=limits)
    tally = SchemaSize()
    stack: list[tuple[Any, int, int]] = [(schema, 1, _SCHEMA)]  # (value, depth, kind)
    while stack:
        value, depth, kind = stack.pop()
        tally.nodes += 1
        tally.literal_nodes += kind == _LITERAL
        if depth > limits.max_depth:
            raise refuse("values are nested", depth, "max_depth")
        if isinstance(value, dict):
            for key, item in value.items():
                if len(key) > limits.max_string_chars:
                    raise refuse("a key has characters:", len(key), "max_string_chars")
                child = kind
                if kind == _MAP:
                    child = _SCHEMA
                elif kind == _SCHEMA:
                    if key in _ANNOTATIONS:
                        continue
                    if key == "properties" and isinstance(item, dict):
                        tally.properties += len(item)
                    if key == "enum" and isinstance(item, list):
                        tally.enum_values += len(item)
                    child = _LITERAL if key in _LITERALS else _MAP if key in _MAPS else _SCHEMA
                stack.append((item, depth + 1, child))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, kind) for item in value)
        elif isinstance(value, str) and len(value) > limits.max_string_chars:
            raise refuse("a string has characters:", len(value), "max_string_chars")
        if tally.nodes > limits.max_nodes:
            raise refuse("JSON values:", tally.nodes, "max_nodes")
        if tally.literal_nodes > limits.max_literal_nodes:
            raise refuse(
                "const and enum values hold JSON values:",
                tally.literal_nodes,
                "max_literal_nodes",
            )
        if tally.properties > limits.max_properties:
            raise refuse("object properties:", tally.properties, "max_properties")
        if tally.enum_values > limits.max_enum_values:
            raise refuse("enum values:", tally.enum_values, "max_enum_values")
    return tally
