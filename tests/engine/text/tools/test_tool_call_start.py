"""Auto tool calls: a call that begins in free text is held to the tools' schemas from its
marker on, in each family's syntax, and its markup never reaches the content.

The engine runs the tiny families' real tokenizers and templates; the model's logits are
replaced by a script (the text a model "wants" to write), so the test decides exactly what is
proposed and the grammar decides what may be taken.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import pytest

from neuron_trio.engine.text.tools.tool_call_format import ToolCallFormat
from neuron_trio.engine.text.tools.tool_call_start import CallStartWatcher, rest_of_call_lark
from neuron_trio.engine.types import Constraint, SamplingParams, ToolFunction
from tests.engine import tiny_families
from tests.engine.scripted_model import engine_for as _engine
from tests.engine.scripted_model import generate as _generate
from tests.engine.scripted_model import script as _script
from tests.engine.tiny_families import write_tiny_family

WEATHER = ToolFunction(
    "get_weather",
    "Weather in a city",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)

MISTRAL_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m.tool_calls %}[TOOL_CALLS]"
    "{{ m.tool_calls | tojson }}{{ eos_token }}{% else %}{{ m['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
LLAMA3_TOOLS_TEMPLATE = tiny_families.LLAMA3_TEMPLATE.replace(
    "{{ bos_token }}", "{{ bos_token }}{% if tools %}ipython <|python_tag|>{% endif %}"
)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


AUTO = SamplingParams(temperature=0.0, max_tokens=120, tools=(WEATHER,))

# family, template (None: the family's own, which knows no tools: neuron renders them
# Hermes-style), the scripted answer (a wrong function name after the marker), the style
CASES = [
    ("qwen2", None, 'Sure <tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}', "hermes"),
    ("gemma3", None, 'Ok.<tool_call>{"name": "rm_rf"}', "hermes"),
    ("mistral", MISTRAL_TOOLS_TEMPLATE, 'Sure [TOOL_CALLS] [{"name": "rm_rf"}]', "mistral"),
    ("llama3", LLAMA3_TOOLS_TEMPLATE, '{"name": "rm_rf", "parameters": {}}', "llama3"),
]


@pytest.mark.parametrize(("family", "template", "script", "style"), CASES)
def test_a_call_begun_in_auto_mode_is_held_to_the_schema(
    family_dir: Path, family: str, template: str | None, script: str, style: str
) -> None:
    engine = _engine(write_tiny_family(family_dir / f"{family}.gguf", family), template)
    assert engine.tool_format.style == style
    _script(engine, script)
    events = _generate(engine, AUTO)
    content = "".join(e.text for e in events)
    calls = [c for e in events for c in e.tool_calls or ()]
    assert events[-1].finish_reason == "tool_calls", (content, events[-1])
    assert len(calls) >= 1 and all(c.name == "get_weather" for c in calls)
    for call in calls:
        args = json.loads(call.arguments)
        assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 8
    marker = ToolCallFormat(style).marker
    assert content.strip() == script.split(marker)[0].strip() if marker else content == ""
    assert "<tool" not in content and "[TOOL" not in content and "{" not in content


def test_mistral_marker_as_one_special_token(
    family_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fam = tiny_families.FAMILIES["mistral"]
    special = dataclasses.replace(fam, specials=(*fam.specials, "[TOOL_CALLS]"))
    monkeypatch.setitem(tiny_families.FAMILIES, "mistral", special)
    engine = _engine(
        write_tiny_family(family_dir / "mistral-special.gguf", "mistral"), MISTRAL_TOOLS_TEMPLATE
    )
    marker_id = engine.tokenizer.token_to_id("[TOOL_CALLS]")
    assert engine.tool_format.open_token_id == marker_id is not None
    ids = _script(engine, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert ids[0] == marker_id
    events = _generate(engine, AUTO)
    calls = [c for e in events for c in e.tool_calls or ()]
    assert events[-1].finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert "".join(e.text for e in events) == ""


def test_plain_text_in_auto_mode_is_content(family_dir: Path) -> None:
    engine = _engine(write_tiny_family(family_dir / "qwen2-text.gguf", "qwen2"))
    _script(engine, "a < b and {x}")
    events = _generate(engine, AUTO)
    assert events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == "a < b and {x}"
    assert not any(e.tool_calls for e in events)


@pytest.mark.parametrize("max_tokens", [1, 3, 12])
def test_a_call_cut_by_max_tokens_leaves_no_markup(family_dir: Path, max_tokens: int) -> None:
    engine = _engine(write_tiny_family(family_dir / "qwen2-cut.gguf", "qwen2"))
    _script(engine, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    events = _generate(engine, dataclasses.replace(AUTO, max_tokens=max_tokens))
    assert events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == ""
    assert not any(e.tool_calls for e in events)


def test_the_watcher_returns_the_tail_from_the_token_the_marker_begins_in() -> None:
    class Vocab:
        token_bytes: ClassVar = [
            b"<eos>",
            b"Sure",
            b" <",
            b"tool",
            b"_call",
            b">\n",
            b'{"',
            b"[TOOL_CALLS]",
        ]
        special_ids = frozenset({0, 7})

    watcher = CallStartWatcher(ToolCallFormat("hermes"), Vocab())
    assert [watcher.push(t) for t in (1, 2, 3, 4)] == [None] * 4
    start = watcher.push(5)
    assert start is not None and start.tokens == (2, 3, 4, 5)
    assert start.prefix == ('" <tool_call>"',)  # ">\n"'s newline is left to the grammar
    assert watcher.push(6) is None  # once only
    lark = rest_of_call_lark(ToolCallFormat("hermes"), [WEATHER], True, start)
    assert lark.startswith('start: " <tool_call>" /[ \\t\\r\\n]{0,4}/ call_json')

    mistral = CallStartWatcher(ToolCallFormat("mistral", open_token_id=7), Vocab())
    assert mistral.push(1) is None
    start = mistral.push(7)
    assert start is not None and start.tokens == (7,) and start.prefix == ("<[7]>",)

    llama = CallStartWatcher(ToolCallFormat("llama3"), Vocab())
    assert llama.push(0) is None  # a special before the answer: no text yet
    start = llama.push(6)
    assert start is not None and start.tokens == (0, 6) and start.prefix == ("<[0]>",)
    text = CallStartWatcher(ToolCallFormat("llama3"), Vocab())
    assert text.push(1) is None and text.done  # an answer in words: never a call

    bare = CallStartWatcher(ToolCallFormat("hermes"), Vocab())  # Qwen2.5-Coder's bare call
    start = bare.push(6)
    assert start is not None and start.bare and start.tokens == (6,) and start.prefix == ()
    lark = rest_of_call_lark(ToolCallFormat("hermes"), [WEATHER], True, start)
    assert lark.startswith("start:  call (/[ \\t\\r\\n]{0,4}/ call){0,3}\ncall: %json")
    words = CallStartWatcher(ToolCallFormat("hermes"), Vocab())  # words first: the tag still
    assert [words.push(t) for t in (1, 6, 2, 3, 4)] == [None] * 5
    assert words.push(5) is not None


@pytest.mark.parametrize(
    ("family", "template"),
    [("qwen2", None), ("mistral", MISTRAL_TOOLS_TEMPLATE), ("llama3", LLAMA3_TOOLS_TEMPLATE)],
)
def test_required_calls_in_each_syntax_parse_back(
    family_dir: Path, family: str, template: str | None
) -> None:
    """`tool_choice: "required"`: a model that would rather chat still calls, in its syntax."""
    engine = _engine(write_tiny_family(family_dir / f"{family}-req.gguf", family), template)
    _script(engine, "hello there")
    required = Constraint("tool_call", tools=(WEATHER,), parallel=True)
    events = _generate(engine, dataclasses.replace(AUTO, constraint=required))
    calls = [c for e in events for c in e.tool_calls or ()]
    assert events[-1].finish_reason == "tool_calls"
    assert calls and all(c.name == "get_weather" for c in calls)
    assert "".join(e.text for e in events) == ""


@pytest.mark.parametrize(
    "script",
    [
        '\n{"name": "rm_rf", "arguments": {"path": "/"}}\n{"name": "x"}',
        '```json\n{\n  "name": "rm_rf",\n  "arguments": {"path": "/"}\n}\n```',
    ],
)
def test_a_hermes_call_without_tags_is_held_to_the_schema(family_dir: Path, script: str) -> None:
    """Qwen2.5-Coder answers `auto` with a call as bare JSON, or in a code fence: from its
    `{` on, the grammar holds it to the tools (here the model wants a tool that does not
    exist), and it comes back as a call, never as content."""
    engine = _engine(write_tiny_family(family_dir / "qwen2-bare.gguf", "qwen2"))
    _script(engine, script)
    events = _generate(engine, AUTO)
    calls = [c for e in events for c in e.tool_calls or ()]
    assert events[-1].finish_reason == "tool_calls"
    assert calls and all(c.name == "get_weather" for c in calls)
    assert all(set(json.loads(c.arguments)) == {"city"} for c in calls)
    assert [e.text for e in events if e.text] == []
