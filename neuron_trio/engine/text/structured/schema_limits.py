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

Counted repetitions (issue 47, #4). A 122-byte `pattern`, `^((X{100}){100}){100}$`, counts
as 3 JSON values but llguidance expands it into a regex of 10^6 characters: its first mask
took 1.6 s and left 175 MB with the cached grammar (measured on the built-in model's
vocabulary: ~175 bytes per expanded character; `(X{1000}){100}`, 10^5: 40 MB, 0.14 s;
`(X{100}){100}`, 10^4: 5 MB, 0.01 s). So each `pattern` (and `patternProperties` key) is
measured as the regex it expands to (`pattern_repeats`: counted repetitions multiply,
sequences and alternatives add), times the items of every array around it
(`minItems`/`maxItems`: 100 items of a 10^4 pattern took 1.0 s and ~90 MB), plus the
`minLength`/`maxLength` that llguidance intersects the pattern with; all of a schema's
together at most `max_pattern_repeats`. A length bound without a pattern is a counter, not
an expansion (`maxLength: 1000000` alone: no cost measured), and is not counted.
"""

from __future__ import annotations

import re
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
    "pattern_repeats",
    "schema_bytes",
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
    # characters all patterns expand to, counted repetitions multiplied out (see above)
    max_pattern_repeats: int = 50_000


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
    pattern_repeats: int = 0

    def __add__(self, other: SchemaSize) -> SchemaSize:
        return SchemaSize(
            self.nodes + other.nodes,
            self.properties + other.properties,
            self.enum_values + other.enum_values,
            self.literal_nodes + other.literal_nodes,
            self.pattern_repeats + other.pattern_repeats,
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
            + 200 * self.pattern_repeats  # ~175 bytes per expanded character, measured
        )


# What a JSON value is to the walk: a schema (its keys are keywords), a map of names to
# schemas (`properties`, `$defs`: every key is a name, never an annotation), or literal data.
_SCHEMA, _MAP, _LITERAL = 0, 1, 2
_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})


def schema_bytes(text: str) -> int:
    """The size of a schema's JSON text in UTF-8 bytes (what `max_bytes` bounds), not its
    characters: 128 K of 4-byte characters are 512 KB."""
    return len(text.encode("utf-8", "surrogatepass"))


_QUANTIFIER = re.compile(r"\{(\d{1,9})(?:(,)(\d{0,9}))?\}")


def pattern_repeats(pattern: str, cap: int) -> int:
    """How many characters the regex `pattern` expands to once its counted repetitions are
    multiplied out (`(X{100}){100}`: 10 000); sequences and alternatives add. Unbounded
    `*`, `+`, `?` count once (a loop, not an expansion). Stops counting past `cap` (the
    answer is then > cap). Linear in the pattern; never recurses."""
    stack: list[list[int]] = [[0, 0, 0]]  # per group: [alternatives' sum, this branch, last atom]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        frame = stack[-1]
        atom = 0
        if c == "\\":
            i += 2
            atom = 1
        elif c == "[":
            i = _class_end(pattern, i)
            atom = 1
        elif c == "(":
            stack.append([0, 0, 0])
            i = _group_body(pattern, i + 1)
            continue
        elif c == ")" and len(stack) > 1:
            done = stack.pop()
            atom = done[0] + done[1]
            frame = stack[-1]
            i += 1
        elif c == "|":
            frame[0] += frame[1]
            frame[1] = frame[2] = 0
            i += 1
            continue
        elif c == "{" and (match := _QUANTIFIER.match(pattern, i)) is not None:
            low, comma, high = match.groups()
            times = int(high) if high else int(low) if not comma or low != "0" else 1
            frame[1] += frame[2] * (max(times, 1) - 1)
            frame[2] *= max(times, 1)
            i = match.end()
        else:
            i += 1
            atom = 0 if c in "*+?^$" else 1
        if atom:
            frame[1] += atom
            frame[2] = atom
        if frame[0] + frame[1] > cap:
            return cap + 1
    while len(stack) > 1:  # an unclosed group: llguidance refuses it; count what it holds
        done = stack.pop()
        stack[-1][1] += done[0] + done[1]
    return min(stack[0][0] + stack[0][1], cap + 1)


def _group_body(pattern: str, i: int) -> int:
    """Past a group's `?:`, `?=`, `?!`, `?P<name>`, `?<name>` (they match nothing)."""
    if pattern.startswith("?", i):
        if pattern.startswith(("?:", "?=", "?!"), i):
            return i + 2
        if pattern.startswith(("?P<", "?<"), i):
            end = pattern.find(">", i)
            return end + 1 if end >= 0 else i + 1
    return i


def _class_end(pattern: str, start: int) -> int:
    """The index after the `]` closing the character class that opens at `start`."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1  # a leading "]" is a member
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _length_bound(schema: dict[str, Any]) -> int:
    """The larger of a string schema's `minLength` and `maxLength` (0 when neither)."""
    bounds = [schema.get(key) for key in ("minLength", "maxLength")]
    return max((b for b in bounds if isinstance(b, int) and not isinstance(b, bool)), default=0)


def _items_bound(schema: dict[str, Any]) -> int:
    """How many times an array schema repeats its items' grammar: `maxItems`, or
    `minItems` when unbounded above (the rest is a loop); at least 1."""
    for key in ("maxItems", "minItems"):
        value = schema.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 1


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
    # (value, depth, kind, how many times the arrays around it repeat it)
    stack: list[tuple[Any, int, int, int]] = [(schema, 1, _SCHEMA, 1)]
    while stack:
        value, depth, kind, times = stack.pop()
        tally.nodes += 1
        tally.literal_nodes += kind == _LITERAL
        if depth > limits.max_depth:
            raise refuse("values are nested", depth, "max_depth")
        if isinstance(value, dict):
            if kind == _SCHEMA:
                tally.pattern_repeats += times * _patterns_of(value, limits.max_pattern_repeats)
            for key, item in value.items():
                if len(key) > limits.max_string_chars:
                    raise refuse("a key has characters:", len(key), "max_string_chars")
                child, child_times = kind, times
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
                    if key == "items":
                        child_times = times * _items_bound(value)
                stack.append((item, depth + 1, child, child_times))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, kind, times) for item in value)
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
        if tally.pattern_repeats > limits.max_pattern_repeats:
            raise refuse(
                "a `pattern`'s counted repetitions (times its arrays' items, plus its "
                "minLength/maxLength) expand to characters:",
                tally.pattern_repeats,
                "max_pattern_repeats",
            )
    return tally


def _patterns_of(schema: dict[str, Any], cap: int) -> int:
    """What the patterns of one schema expand to: its `pattern` (with the length bounds
    llguidance intersects it with) and its `patternProperties`' keys. Strings over
    `max_string_chars` are refused by the walk on its own."""
    total = 0
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        total += pattern_repeats(pattern, cap) + _length_bound(schema)
    keyed = schema.get("patternProperties")
    if isinstance(keyed, dict):
        total += sum(pattern_repeats(key, cap) for key in keyed if isinstance(key, str))
    return total
