"""Bounds on a schema before the grammar compiler sees it (issue 25, findings 1 and 3)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from neuron_trio.engine.text.grammar_cache import GrammarCache
from neuron_trio.engine.text.schema_limits import (
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
