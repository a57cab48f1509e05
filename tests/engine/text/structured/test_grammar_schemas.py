"""JSON Schema as clients write it, through the grammar compiler (issue 26 item 2), and
the compiler's failures as one-line 400s (issue 25 finding 1)."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import openai
import pytest
from pydantic import BaseModel

from neuron_trio.engine.text.structured import grammar
from neuron_trio.engine.text.structured.schema_prep import close_objects, one_line, rebase_refs
from neuron_trio.engine.text.tools.tool_call_format import ToolCallFormat
from neuron_trio.engine.types import Constraint, ToolFunction
from neuron_trio.errors import RequestError
from tests.engine.text.char_vocab import EOS, IM_END, VOCAB, allowed_ids, char_compiler


class Address(BaseModel):
    street: str
    city: str | None


class Person(BaseModel):
    name: str
    home: Address
    kind: str | None


def _walks(state: Any, text: str) -> bool:
    """`text` is allowed character by character, and the grammar may end after it."""
    for ch in text:
        token = VOCAB.index(ch)
        if token not in allowed_ids(state):
            return False
        state.accept(token)
    return bool(allowed_ids(state) & {EOS, IM_END})


def _json(schema: Any, *, strict: bool = False) -> Constraint:
    return Constraint("json", schema=json.dumps(schema), strict=strict)


def test_pydantic_function_tool_with_a_nested_model_compiles_and_follows_its_refs() -> None:
    tool = openai.pydantic_function_tool(Person, name="person")["function"]
    assert "$defs" in tool["parameters"]  # the nested model is a local $ref
    function = ToolFunction(tool["name"], "", json.dumps(tool["parameters"]), strict=True)
    args = '{"name":"a","home":{"street":"b","city":null},"kind":"c"}'
    for tools in ((function,), (function, ToolFunction("other"))):
        state = char_compiler().compile(Constraint("tool_call", tools=tools))
        assert _walks(
            state, '<tool_call>\n{"name":"person","arguments":' + args + "}\n</tool_call>"
        )
    # the $ref is enforced: the nested object must be an Address
    state = char_compiler().compile(Constraint("tool_call", tools=(function,)))
    assert not _walks(state, '<tool_call>\n{"name":"person","arguments":{"name":"a","home":1')


def test_response_format_takes_defs_anyof_null_enum_and_nested_objects() -> None:
    schema = Person.model_json_schema()
    state = char_compiler().compile(_json(schema))
    assert _walks(state, '{"name":"a","home":{"street":"b","city":null},"kind":null}')
    state = char_compiler().compile(_json({"enum": ["red", "green", None]}))
    assert _walks(state, '"green"')


def test_strict_closes_objects_that_do_not_say_otherwise() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert _walks(char_compiler().compile(_json(schema)), '{"a":1,"b":2}')
    assert not _walks(char_compiler().compile(_json(schema, strict=True)), '{"a":1,"b":2}')
    assert _walks(char_compiler().compile(_json(schema, strict=True)), '{"a":1}')
    schema["additionalProperties"] = True  # said otherwise: kept open
    assert _walks(char_compiler().compile(_json(schema, strict=True)), '{"a":1,"b":2}')


def test_a_demanded_call_admits_no_key_its_schema_does_not_name_unless_it_says_so() -> None:
    """`required`/named, not `strict`: a sampled small model invented keys until max_tokens
    cut the call off. A call the model begins itself (`auto`) keeps its schema as written."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    def walks(parameters: Any, arguments: str) -> bool:
        tool = ToolFunction("w", "", json.dumps(parameters))
        state = char_compiler().compile(Constraint("tool_call", tools=(tool,)))
        call = '<tool_call>\n{"name":"w","arguments":' + arguments + "}\n</tool_call>"
        return _walks(state, call)

    assert walks(weather, '{"city":"a"}')
    assert not walks(weather, '{"city":"a","x":"b"}')
    assert walks({**weather, "additionalProperties": True}, '{"city":"a","x":"b"}')
    assert walks({"type": "object", "properties": {}}, "{}")
    assert not walks({"type": "object", "properties": {}}, '{"x":1}')
    # a bare object is a free-form dictionary, at the top and nested; strict closes it
    assert walks({"type": "object"}, '{"x":1}')
    nested = {"type": "object", "properties": {"meta": {"type": "object"}}}
    assert walks(nested, '{"meta":{"k":1}}') and not walks(nested, '{"meta":{},"x":1}')

    def auto_arguments(strict: bool) -> Any:  # the schema the auto path's grammar embeds
        tool = ToolFunction("w", "", json.dumps(weather), strict=strict)
        body = ToolCallFormat("hermes").call_json([tool])
        return json.loads(body.removeprefix("%json "))["properties"]["arguments"]

    assert "additionalProperties" not in auto_arguments(strict=False)
    assert auto_arguments(strict=True)["additionalProperties"] is False
    tool = ToolFunction("w", "", '{"type":"object"}', strict=True)
    assert ToolCallFormat("hermes").prepare_parameters([tool])[0]["additionalProperties"] is False


def test_close_objects_and_rebase_refs_reach_every_subschema() -> None:
    schema: dict[str, Any] = {
        "$defs": {"x": {"type": "object", "properties": {"properties": {"$ref": "#"}}}},
        "anyOf": [{"properties": {"y": {"$ref": "#/$defs/x"}}}],
        "const": {"type": "object"},  # data: never touched
    }
    close_objects(schema)
    rebase_refs(schema, "/properties/arguments", param="tools")
    assert schema["$defs"]["x"]["additionalProperties"] is False
    assert schema["anyOf"][0]["additionalProperties"] is False
    assert schema["const"] == {"type": "object"}
    assert schema["$defs"]["x"]["properties"]["properties"]["$ref"] == "#/properties/arguments"
    assert schema["anyOf"][0]["properties"]["y"]["$ref"] == "#/properties/arguments/$defs/x"


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"$ref": "https://example.com/s.json"}, "$ref https://example.com/s.json"),
        ({"type": "object", "if": {}, "then": {}}, '"if"'),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "integer", "minimum": -1e300, "maximum": 1e300}, "integer"),
    ],
)
def test_an_unsupported_feature_is_one_line_naming_it(schema: Any, words: str) -> None:
    with pytest.raises(RequestError) as err:
        char_compiler().compile(_json(schema))
    message = err.value.message
    assert err.value.status == 400 and words in message
    assert "\n" not in message and " | " not in message and "start:" not in message
    assert message.startswith("response_format.json_schema.schema: ")


def test_a_tool_with_a_remote_ref_is_a_400_naming_the_tool() -> None:
    tool = ToolFunction("lookup", "", '{"type":"object","properties":{"a":{"$ref":"x.json"}}}')
    with pytest.raises(RequestError, match=r"tools\[lookup\]\.function\.parameters: \$ref x"):
        char_compiler().compile(Constraint("tool_call", tools=(tool,)))


def test_a_tools_schema_over_the_bounds_is_refused_before_compiling() -> None:
    big = json.dumps({"const": {f"k{i}": i for i in range(3_000)}})
    with pytest.raises(RequestError, match=r"tools\[f\]\.function\.parameters: .*max_literal"):
        char_compiler().compile(Constraint("tool_call", tools=(ToolFunction("f", "", big),)))
    with pytest.raises(RequestError, match=r"response_format.*max_literal_nodes"):
        char_compiler().compile(Constraint("json", schema=big))


def test_a_rust_panic_in_the_compiler_is_a_400_not_a_dead_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class PanicException(BaseException):  # pyo3's: a BaseException, named so
        pass

    def panics(*args: Any, **kwargs: Any) -> Any:
        raise PanicException(
            "assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>..."
        )

    monkeypatch.setattr(grammar.llguidance, "LLMatcher", _Patched(panics))
    with pytest.raises(RequestError) as err:
        char_compiler().compile(_json({"type": "object"}))
    assert err.value.status == 400 and "grammar.symbols.len()" in err.value.message
    assert "backtrace" not in err.value.message


def test_other_base_exceptions_still_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(grammar.llguidance, "LLMatcher", _Patched(interrupted))
    with pytest.raises(KeyboardInterrupt):
        char_compiler().compile(_json({"type": "object"}))


class _Patched:
    """llguidance.LLMatcher with its constructor replaced, its static helpers kept."""

    def __init__(self, new: Any) -> None:
        self._new = new
        self.grammar_from_json_schema = llguidance.LLMatcher.grammar_from_json_schema
        self.grammar_from_lark = llguidance.LLMatcher.grammar_from_lark

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._new(*args, **kwargs)


def test_one_line_drops_the_dump_and_the_backtrace() -> None:
    dump = (
        "at 2(7): failed to compile JSON schema: Pointer '/$defs/A' does not exist "
        '1 | start: call 2 | call: "<tool_call>"\nmore\nlines'
    )
    assert one_line(dump) == (
        "at 2(7): failed to compile JSON schema: Pointer '/$defs/A' does not exist"
    )
    assert one_line("panic: boom <backtrace> 0: x") == "boom"
    assert one_line("") == "the grammar is invalid"
    assert len(one_line("x" * 1000)) == 300


def test_a_panic_while_masking_ends_that_sequence_not_the_step() -> None:
    class PanicException(BaseException):
        pass

    class PanickingMatcher:
        def is_error(self) -> bool:
            return False

        def is_stopped(self) -> bool:
            return False

        def unsafe_compute_mask_ptr(self, *args: Any) -> None:
            raise PanicException("index out of bounds\n<backtrace>")

        def consume_token(self, token: int) -> bool:
            raise PanicException("boom")

    state = grammar.GrammarState(PanickingMatcher())
    assert grammar.fill_masks([state], 64) is not None  # the row stays all ones
    assert state.error == "the grammar engine failed: index out of bounds"
    assert not state.finished
    state.accept(3)  # ignored once failed
