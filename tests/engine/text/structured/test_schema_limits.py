"""Bounds on a schema before the grammar compiler sees it (issue 25, findings 1 and 3)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from neuron_trio.engine.text.structured.grammar_cache import GrammarCache
from neuron_trio.engine.text.structured.schema_limits import (
    DEFAULT_LIMITS,
    SchemaLimits,
    SchemaTooComplexError,
    check_schema,
)
from neuron_trio.errors import RequestError

PARAM = "response_format.json_schema.schema"


def _check(schema: Any, limits: SchemaLimits = DEFAULT_LIMITS) -> None:
    check_schema(schema, param=PARAM, size=len(json.dumps(schema)), limits=limits)


def _nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        node = {"type": "array", "items": node}
    return node


@pytest.mark.parametrize(
    ("schema", "field"),
    [
        ({"const": {f"k{i}": i for i in range(30_000)}}, "max_bytes"),  # the crashing input
        ({"const": {f"k{i}": i for i in range(3_000)}}, "max_literal_nodes"),
        ({"const": list(range(3_000))}, "max_literal_nodes"),
        ({"enum": [f"v{i}" for i in range(1_001)]}, "max_enum_values"),
        (
            {"type": "object", "properties": {f"p{i}": {} for i in range(1_001)}},
            "max_properties",
        ),
        (_nested(60), "max_depth"),
        ({"type": "string", "pattern": "a" * 5_000}, "max_string_chars"),
        ({"type": "object", "properties": {"k" * 5_000: {}}}, "max_string_chars"),
        ({"anyOf": [{"type": "integer"} for _ in range(6_000)]}, "max_nodes"),
    ],
)
def test_each_bound_is_a_400_naming_the_field_and_the_limit(schema: Any, field: str) -> None:
    started = time.perf_counter()
    with pytest.raises(SchemaTooComplexError) as err:
        _check(schema)
    assert time.perf_counter() - started < 5  # linear: never the compiler's seconds
    error = err.value
    assert isinstance(error, RequestError) and error.status == 400
    assert error.param == PARAM and error.code == "schema_too_complex"
    assert error.message.startswith(PARAM + ": ")
    assert f"SchemaLimits.{field}" in error.message
    assert str(getattr(DEFAULT_LIMITS, field)) in error.message
    assert "\n" not in error.message


def test_what_clients_write_passes_and_is_counted() -> None:
    schema = {
        "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}}},
        "type": "object",
        "properties": {
            "name": {"type": "string", "description": "x" * 20_000},  # an annotation
            "kind": {"enum": ["a", "b", None]},
            "home": {"$ref": "#/$defs/Address"},
            "description": {"type": "string"},  # a property of that name counts
        },
    }
    size = check_schema(schema, param=PARAM, size=100)
    assert size.properties == 5 and size.enum_values == 3 and size.literal_nodes == 4
    assert size.estimated_bytes() < 8 << 20


def test_annotations_are_not_compiled_so_only_bytes_bound_them() -> None:
    _check({"type": "string", "description": "d" * 50_000, "examples": list(range(5_000))})
    with pytest.raises(SchemaTooComplexError, match="max_string_chars"):
        _check({"type": "string", "const": "d" * 50_000})


def test_limits_are_a_value_callers_may_tighten() -> None:
    tight = SchemaLimits(max_depth=3)
    _check(_nested(1), tight)
    with pytest.raises(SchemaTooComplexError, match=r"limit of 3 \(SchemaLimits.max_depth\)"):
        _check(_nested(5), tight)


def test_a_nesting_deeper_than_pythons_stack_is_refused_not_crashed_on() -> None:
    node: Any = {}
    for _ in range(100_000):
        node = {"items": node}
    with pytest.raises(SchemaTooComplexError, match="max_depth"):
        check_schema(node, param=PARAM, size=10)


# ---- the cache's byte bound ----------------------------------------------------------------


def test_the_cache_keeps_its_estimated_bytes_under_the_budget() -> None:
    cache = GrammarCache(max_entries=10, max_bytes=100)
    for key in "abcd":
        cache.put(key, key.upper(), 30)
    stats = cache.statistics()
    assert stats.entries == 3 and stats.estimated_bytes == 90 and stats.evictions == 1
    assert cache.get("a") is None and cache.get("b") == "B"  # the oldest went first
    cache.put("e", "E", 60)  # "c" and "d" go ("b" was used last)
    assert cache.get("b") == "B" and cache.get("e") == "E" and cache.get("c") is None
    assert cache.statistics().estimated_bytes == 90


def test_the_cache_keeps_its_entry_count_under_the_bound() -> None:
    cache = GrammarCache(max_entries=2, max_bytes=1 << 30)
    for key in "abc":
        cache.put(key, key, 1)
    assert len(cache) == 2 and cache.get("a") is None


def test_what_could_never_fit_is_refused_before_compiling() -> None:
    cache = GrammarCache(max_entries=2, max_bytes=64 << 20)
    cache.admit(64 << 20, param="tools")
    with pytest.raises(RequestError) as err:
        cache.admit(65 << 20, param="tools")
    assert err.value.status == 400 and err.value.param == "tools"
    assert "grammar_cache.CACHE_BYTES" in err.value.message


# ---- issue 47 (#4): bounds by what things cost ---------------------------------------------


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^((X{100}){100}){100}$"},  # 122 bytes, 175 MB kept
        {"type": "string", "pattern": "^(?:(X{100}){100}){6}$"},
        {"type": "string", "pattern": "^(a|b{1000}){60}$"},
        {"type": "string", "pattern": "^[ab]{1,60000}$"},
        {"type": "string", "pattern": "^[ab]+$", "minLength": 60_000},  # length as repetition
        {"type": "string", "pattern": "^(X{100}){10}$", "maxLength": 60_000},
        {"type": "array", "items": {"type": "string", "pattern": "^X{1000}$"}, "maxItems": 100},
        {"type": "object", "patternProperties": {"^(k{300}){300}$": {}}},
        {"type": "object", "properties": {f"p{i}": {"pattern": "x{9000}"} for i in range(6)}},
    ],
)
def test_a_pattern_whose_repetitions_multiply_past_the_bound_is_a_400_naming_pattern(
    schema: Any,
) -> None:
    with pytest.raises(SchemaTooComplexError) as err:
        _check(schema)
    assert err.value.status == 400 and err.value.param == PARAM
    assert "`pattern`" in err.value.message
    assert "SchemaLimits.max_pattern_repeats" in err.value.message


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^(X{100}){100}$"},  # 10^4: 5 MB, 0.01 s measured
        {"type": "string", "pattern": r"^\d{3}-\d{4}$", "maxLength": 8},
        {"type": "string", "pattern": r"^[\]{}]{3}\{100000\}$"},  # escaped, not counted
        {"type": "string", "maxLength": 1_000_000},  # a counter, not an expansion
        {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}, "maxItems": 1000},
    ],
)
def test_patterns_clients_write_pass(schema: Any) -> None:
    assert _check_size(schema).pattern_repeats <= DEFAULT_LIMITS.max_pattern_repeats


def _check_size(schema: Any) -> Any:
    return check_schema(schema, param=PARAM, size=len(json.dumps(schema)))


@pytest.mark.parametrize(
    ("pattern", "expands_to"),
    [
        ("^((X{100}){100}){100}$", 1_000_000),
        ("^(((X{100}){100}){100}){100}$", 1_000_001),  # past the cap: cap + 1
        ("(X{100}){100}", 10_000),
        ("a{3}b{2,5}c{4,}", 12),
        ("(a|bc){10}", 30),
        ("(?:ab){3}(?P<n>c){2}", 8),
        (r"\{3\}[{}]{2}", 5),
        ("x*y+z?", 3),
    ],
)
def test_pattern_repeats_multiplies_counted_repetitions(pattern: str, expands_to: int) -> None:
    from neuron_trio.engine.text.structured.schema_limits import pattern_repeats

    assert pattern_repeats(pattern, cap=1_000_000) == min(expands_to, 1_000_001)


def test_the_byte_limit_counts_utf8_bytes_not_characters() -> None:
    """40 000 four-byte characters are 160 KB, over the 128 KB limit, though 40 000
    characters are under it: the limit counted characters."""
    from neuron_trio.engine.types import Constraint, ToolFunction
    from tests.engine.text.char_vocab import char_compiler

    schema = json.dumps(
        {"type": "string", "description": "\U0001f600" * 40_000}, ensure_ascii=False
    )
    assert len(schema) < DEFAULT_LIMITS.max_bytes < len(schema.encode())
    with pytest.raises(SchemaTooComplexError, match=r"SchemaLimits\.max_bytes"):
        char_compiler().compile(Constraint(kind="json", schema=schema))
    tool = ToolFunction(name="f", parameters=schema)  # a tool's parameters: the same bound
    with pytest.raises(SchemaTooComplexError, match=r"SchemaLimits\.max_bytes"):
        char_compiler().compile(Constraint(kind="tool_call", tools=(tool,)))


def test_the_cache_charges_an_entry_what_the_heap_grew_by(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A grammar estimated at 4 MB kept 175 MB: the cache now charges the measure."""
    from neuron_trio.engine.text.structured import grammar
    from neuron_trio.engine.types import Constraint
    from tests.engine.text.char_vocab import char_compiler

    class Grew:
        def __init__(self) -> None:
            self.grown = 0

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            self.grown = 100 << 20

    monkeypatch.setattr(grammar, "HeapMeter", Grew)
    compiler = char_compiler()
    compiler.compile(Constraint(kind="json", schema='{"type": "string"}'))
    assert compiler.cache.statistics().estimated_bytes == 100 << 20
    compiler.cache.max_bytes = 64 << 20  # what took more than the whole cache is not kept
    with pytest.raises(RequestError, match="took about 100 MB"):
        compiler.compile(Constraint(kind="json", schema='{"type": "integer"}'))


def test_the_heap_meter_sees_native_allocations() -> None:
    from neuron_trio.engine.text.structured.grammar_cache import HeapMeter, heap_bytes

    assert heap_bytes() is not None  # glibc (the node's platform)
    with HeapMeter() as meter:
        block = bytearray(40 << 20)  # CPython allocates it with malloc, as Rust does
    assert meter.grown >= 40 << 20
    del block
