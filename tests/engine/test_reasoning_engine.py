"""A thinking model on the tiny Qwen3 family with a thinking template: its thinking comes
apart from its answer event by event, a tool call after the thinking still parses (and is
held to the schema), and `enable_thinking: false` or a template that opens the thinking
itself decide where the output starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from neuron_trio.engine.types import Constraint, SamplingParams, SequenceEvent, ToolFunction
from tests.engine import tiny_families
from tests.engine.scripted_model import engine_for, generate, script
from tests.engine.tiny_families import write_tiny_family

WEATHER = ToolFunction(
    "get_weather",
    "",
    json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}),
)

# Qwen3's template, cut to what matters here: ChatML, a generation prompt that holds an empty
# thinking when `enable_thinking` is false, and tools (its source mentions them).
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tools></tools>{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's distills open the thinking in the prompt.
R1_TEMPLATE = QWEN3_TEMPLATE.replace("assistant\n{% if", "assistant\n<think>\n{% if")

GREEDY = SamplingParams(temperature=0.0, max_tokens=200)
AUTO = dataclasses.replace(GREEDY, tools=(WEATHER,))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_family(tmp_path_factory.mktemp("qwen3") / "qwen3.gguf", "qwen3")


def _parts(events: list[SequenceEvent]) -> tuple[str, str, list[tuple[str, dict[str, str]]]]:
    calls = [(c.name, json.loads(c.arguments)) for e in events for c in e.tool_calls or ()]
    return "".join(e.reasoning for e in events), "".join(e.text for e in events), calls


def test_thinking_goes_apart_from_the_answer(qwen3: Path) -> None:
    engine = engine_for(qwen3, QWEN3_TEMPLATE)
    script(engine, "<think>\nThe user says hello.\n</think>\n\nHello!")
    events = generate(engine, GREEDY)
    assert _parts(events) == ("The user says hello.", "Hello!", [])
    assert events[-1].finish_reason == "stop"
    # streamed: no event carries thinking in its text, none the answer in its reasoning
    assert all("Hello!" not in e.reasoning and "user" not in e.text for e in events)


@pytest.mark.parametrize(
    "call",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        '{"name": "rm_rf", "arguments": {"city": "Oslo"}}',  # bare, held to the schema
    ],
)
def test_a_tool_call_after_the_thinking_parses(qwen3: Path, call: str) -> None:
    engine = engine_for(qwen3, QWEN3_TEMPLATE)
    script(engine, '<think>\n{"a"} <tool_call>\n</think>\n\n' + call)
    events = generate(engine, AUTO)
    reasoning, content, calls = _parts(events)
    assert reasoning == '{"a"} <tool_call>'  # not a call in there
    assert content == ""
    assert [name for name, _ in calls] == ["get_weather"]
    assert events[-1].finish_reason == "tool_calls"


def test_enable_thinking_false_starts_in_the_answer(qwen3: Path) -> None:
    engine = engine_for(qwen3, QWEN3_TEMPLATE)
    script(engine, "Hi </think> there")
    events = generate(engine, GREEDY, {"enable_thinking": False})
    assert _parts(events) == ("", "Hi </think> there", [])


def test_a_template_that_opens_the_thinking_starts_inside_it(qwen3: Path) -> None:
    engine = engine_for(qwen3, R1_TEMPLATE)
    script(engine, "Short thought.</think>\n\nHello.")
    assert _parts(generate(engine, GREEDY)) == ("Short thought.", "Hello.", [])


def test_a_constrained_answer_is_not_thinking(qwen3: Path) -> None:
    engine = engine_for(qwen3, R1_TEMPLATE)
    script(engine, "hmm")
    required = Constraint("tool_call", tools=(WEATHER,))
    reasoning, content, calls = _parts(
        generate(engine, dataclasses.replace(AUTO, constraint=required))
    )
    assert reasoning == "" and content == "" and [n for n, _ in calls] == ["get_weather"]


def test_think_tags_held_as_special_tokens_still_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF may mark `<think>` and `</think>` as control tokens, which the answer's text
    would not show: the splitter must see them all the same."""
    fam = tiny_families.FAMILIES["qwen3"]
    tags = dataclasses.replace(fam, specials=(*fam.specials, "<think>", "</think>"))
    monkeypatch.setitem(tiny_families.FAMILIES, "qwen3", tags)
    engine = engine_for(write_tiny_family(tmp_path / "qwen3-tags.gguf", "qwen3"), QWEN3_TEMPLATE)
    assert engine.tokenizer.token_to_id("</think>") in engine.tokenizer.special_ids
    ids = script(engine, "<think>Hmm.</think>Hello!")
    assert ids[0] == engine.tokenizer.token_to_id("<think>")
    assert _parts(generate(engine, GREEDY)) == ("Hmm.", "Hello!", [])
