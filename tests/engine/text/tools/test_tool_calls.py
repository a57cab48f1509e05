"""Tool calls read out of streamed text, and tools rendered for templates that know none."""

from __future__ import annotations

import json

from neuron_trio.engine.text.tools.tool_call_format import ToolCallFormat
from neuron_trio.engine.text.tools.tool_call_parser import ToolCallParser
from neuron_trio.engine.text.tools.tool_calls import render_tools_as_text
from neuron_trio.engine.types import ToolFunction

WEATHER = ToolFunction("get_weather", "Weather in a city", '{"type":"object"}')
TIME = ToolFunction("get_time", "", '{"type":"object"}')


def _feed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[str]]:
    text, names = "", []
    for i, piece in enumerate(pieces):
        shown, calls = parser.push(piece, final=i == len(pieces) - 1)
        text += shown
        names += [f"{c.name}{c.arguments}" for c in calls]
    return text, names


def test_hermes_calls_split_across_pieces_are_held_back_then_parsed() -> None:
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER, TIME])
    pieces = ["Let me check.", "<tool", '_call>\n{"name": "get_weather", "argu', 'ments": {"city"']
    pieces += [': "Paris"}}\n</tool_', "call>\n<tool_call>", '{"name":"get_time","arguments":{}}']
    pieces += ["</tool_call>", ""]
    shown = []
    for i, piece in enumerate(pieces):
        text, _ = parser.push(piece, final=i == len(pieces) - 1)
        shown.append(text)
        assert "<" not in text, shown  # never half a tag
    assert "".join(shown).strip() == "Let me check."
    assert [c.name for c in parser.calls] == ["get_weather", "get_time"]
    assert json.loads(parser.calls[0].arguments) == {"city": "Paris"}
    assert parser.calls[0].id.startswith("call_") and parser.calls[0].id != parser.calls[1].id


def test_hermes_blocks_that_are_not_calls_never_reach_the_content() -> None:
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
    text, calls = _feed(
        parser, ['Hm. <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok', ""]
    )
    assert calls == [] and text == "Hm.  ok"
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
    text, calls = _feed(parser, ["a < b, and <tool_call>{not json", ""])
    assert calls == [] and text == "a < b, and "


def test_a_closing_marker_inside_an_argument_string_does_not_end_the_call() -> None:
    """A sampled model named a city "</tool_call>Paris": the call was cut there, dropped, and
    the rest (`Paris"}}</tool_call>`) shown as content."""
    city = (
        'a \\"</tool_call> \\\\\\"</tool_call>Paris'  # JSON: a \"</tool_call> \\\"</tool_call>Paris
    )
    call = '{"name": "get_weather", "arguments": {"city": "' + city + '"}}'
    for pieces in (["<tool_call>\n" + call + "\n</tool_call> done", ""], list(call)):
        parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
        if len(pieces) > 2:
            pieces = ["<tool_call>", *pieces, "</tool_call> done", ""]
        text, calls = _feed(parser, pieces)
        assert text == "done"  # the space after a call is dropped with it
        assert calls == ["get_weather" + json.dumps({"city": json.loads('"' + city + '"')})]
    # many markers in many strings, the call streamed in pieces: one call, every key kept
    arguments = {f"k{i}": "</tool_call>" for i in range(300)}
    call = json.dumps({"name": "get_weather", "arguments": arguments})
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
    pieces = ["<tool_call>"] + [call[i : i + 7] for i in range(0, len(call), 7)]
    assert _feed(parser, [*pieces, "</tool_call>", ""]) == (
        "",
        ["get_weather" + json.dumps(arguments)],
    )
    # not JSON: its first marker still ends the block (dropped, the rest is content)
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
    assert _feed(parser, ['<tool_call>say "</tool_call> ok', ""]) == (" ok", [])


def test_a_marker_cut_by_max_tokens_is_dropped_but_a_finished_answer_keeps_its_text() -> None:
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
    assert parser.push("<", final=True, cut=True) == ("", [])  # max_tokens 1: no "<" leak
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
    assert parser.push("x <tool", final=True, cut=True) == ("x ", [])
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
    assert parser.push("1 <", final=True) == ("1 <", [])  # the model ended there: text
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
    shown, _ = parser.push('<tool_call>\n{"name": "get_weather", "argu', final=False)
    assert shown == ""
    assert parser.push("ments", final=True, cut=True) == ("", [])


def test_mistral_tool_calls_list_is_parsed_and_held_back() -> None:
    parser = ToolCallParser(ToolCallFormat("mistral"), [WEATHER, TIME])
    pieces = [
        "Sure",
        ". [TOOL",
        "_CALLS] [",
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
    ]
    pieces += [', {"name": "get_time", "arguments": {}}', "]", ""]
    shown = [parser.push(p, final=i == len(pieces) - 1)[0] for i, p in enumerate(pieces)]
    assert "".join(shown) == "Sure." and all("[" not in s for s in shown)
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    parser = ToolCallParser(ToolCallFormat("mistral"), [WEATHER])
    assert _feed(parser, ['[TOOL_CALLS][{"name": "get_weather", "argum', ""]) == ("", [])


def test_llama3_answer_that_is_one_json_object_is_a_call() -> None:
    parser = ToolCallParser(ToolCallFormat("llama3"), [WEATHER])
    text, calls = _feed(
        parser, ['<|python_tag|>{"name": "get_weather", ', '"parameters": {"x": 1}}', ""]
    )
    assert text == "" and calls == ['get_weather{"x": 1}']
    parser = ToolCallParser(ToolCallFormat("llama3"), [WEATHER])
    text, calls = _feed(parser, ["It is ", "sunny.", ""])
    assert text == "It is sunny." and calls == []
    parser = ToolCallParser(ToolCallFormat("llama3"), [WEATHER])  # the tag is markup too
    assert _feed(parser, ["<|python_tag|>", "print(1)", ""]) == ("print(1)", [])
    parser = ToolCallParser(ToolCallFormat("llama3"), [WEATHER])  # a call cut short: dropped
    assert _feed(parser, ['{"name": "get_weather", "param', ""]) == ("", [])


def test_tools_and_tool_history_become_text_for_a_plain_template() -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
    ]
    out = render_tools_as_text(history, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert "<tools>" in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in out[2]["content"]
    )
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>"
    with_system = render_tools_as_text([{"role": "system", "content": "Be brief."}], [WEATHER])
    assert len(with_system) == 1 and with_system[0]["content"].startswith("Be brief.")


def test_without_parallel_calls_only_the_first_counts() -> None:
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER, TIME], parallel=False)
    one = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    text, calls = _feed(parser, [one, "\n" + one, ""])
    assert calls == ["get_time{}"] and text == ""


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] + [""]


def test_hermes_calls_without_tags_that_open_the_answer_are_calls() -> None:
    """Qwen2.5-Coder writes its calls as bare JSON; "arguments" may be a string of JSON."""
    answer = (
        '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n'
    )
    for pieces in (_pieces(answer), [answer, ""], _pieces(answer, 1)):
        parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER, TIME])
        assert _feed(parser, pieces) == (
            "",
            ['get_weather{"city": "Paris"}', 'get_time{"tz": "CET"}'],
        )


def test_json_that_is_no_call_or_follows_words_stays_content() -> None:
    for answer in ('{"answer": 42}', 'Use {"name": "get_weather"} like this', '{"a": '):
        parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
        assert _feed(parser, _pieces(answer)) == (answer, [])
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])  # cut by max_tokens: dropped
    assert parser.push('{"name": "get_weather", "argu', final=True, cut=True) == ("", [])


def test_several_streamed_calls_send_no_whitespace_between_them() -> None:
    one = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    two, three = one.replace("{}", '{"tz": "CET"}'), one.replace("{}", '{"tz": "UTC"}')
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER, TIME])
    shown = [parser.push(p, final=False)[0] for p in _pieces(f"{one}\n\n\n{two}\n{three}\n", 4)]
    shown.append(parser.push("", final=True)[0])
    assert [s for s in shown if s] == [] and len(parser.calls) == 3
    parser = ToolCallParser(ToolCallFormat("hermes"), [TIME])  # words before a call stay
    assert _feed(parser, _pieces(f"Let me check.\n\n{one}\n", 2)) == (
        "Let me check.",
        ["get_time{}"],
    )
    parser = ToolCallParser(ToolCallFormat("hermes"), [TIME])  # no call: the text is whole
    assert _feed(parser, _pieces("a\n\nb \n", 2)) == ("a\n\nb \n", [])


def test_llama3_several_calls_separated_by_semicolons() -> None:
    parser = ToolCallParser(ToolCallFormat("llama3"), [WEATHER, TIME])
    answer = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    assert _feed(parser, _pieces(answer, 5)) == ("", ['get_weather{"city": "Oslo"}', "get_time{}"])


def test_mistral_named_calls_with_args_markers() -> None:
    answer = (
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
        "[TOOL_CALLS]get_time[CALL_ID]abc123[ARGS]{}"
    )
    for pieces in (_pieces(answer, 4), [answer, ""]):
        parser = ToolCallParser(ToolCallFormat("mistral_args"), [WEATHER, TIME])
        assert _feed(parser, pieces) == ("Sure.", ['get_weather{"city": "Oslo"}', "get_time{}"])
    parser = ToolCallParser(ToolCallFormat("mistral_args"), [WEATHER])  # unknown: dropped
    assert _feed(parser, ["ok [TOOL_CALLS]rm_rf[ARGS]{}", ""]) == ("ok ", [])
    parser = ToolCallParser(ToolCallFormat("mistral_args"), [WEATHER])  # the list form too
    list_form = '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]'
    assert _feed(parser, [list_form, ""]) == ("", ["get_weather{}"])


def test_hermes_calls_in_a_code_fence_that_opens_the_answer_are_calls() -> None:
    """Qwen2.5-Coder-0.5B answered a get_weather question on `auto` with this, exactly."""
    answer = (
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
    )
    for pieces in (_pieces(answer, 2), [answer, ""]):
        parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
        assert _feed(parser, pieces) == ("", ['get_weather{"city": "Paris"}'])
    for text in ("```python\nprint(1)\n```", '```json\n{"answer": 1}\n```', "``", "`x`"):
        parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
        assert _feed(parser, _pieces(text, 2)) == (text, [])


def test_a_call_repeated_in_one_answer_counts_once() -> None:
    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    other = '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    parser = ToolCallParser(ToolCallFormat("hermes"), [WEATHER])
    assert _feed(parser, [one, one, other, one, ""]) == (
        "",
        ['get_weather{"city": "Paris"}', 'get_weather{"city": "Oslo"}'],
    )
