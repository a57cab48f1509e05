"""Each dialect on its family's tiny model, on `auto`: Mistral's `[TOOL_CALLS]name[ARGS]{…}`
(newer templates), Llama 3.x's several calls, and a model's `tool_call_format` setting over
what its template says. The model writes a script (`scripted_model`); the grammar decides."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from neuron_trio.config import load_config
from neuron_trio.engine.text.chat import ChatTemplate
from neuron_trio.engine.types import Constraint, SamplingParams, ToolFunction
from neuron_trio.errors import ConfigError
from tests.engine import tiny_families
from tests.engine.scripted_model import engine_for, generate, script
from tests.engine.tiny_families import write_tiny_family

WEATHER = ToolFunction(
    "get_weather",
    "",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)
AUTO = SamplingParams(temperature=0.0, max_tokens=150, tools=(WEATHER,))

# Mistral Small 3.2's way of writing an assistant's calls (its template, cut short).
MISTRAL_ARGS_TEMPLATE = tiny_families.MISTRAL_TEMPLATE.replace(
    "{% else %}",
    "{% elif message.tool_calls %}{% for c in message.tool_calls %}[TOOL_CALLS]"
    "{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}{% else %}",
)
LLAMA3_TOOLS_TEMPLATE = tiny_families.LLAMA3_TEMPLATE.replace(
    "{{ bos_token }}", "{{ bos_token }}{% if tools %}ipython <|python_tag|>{% endif %}"
)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dialects")


def _calls(events: list) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for e in events for c in e.tool_calls or ()]


def test_mistral_name_args_calls_are_held_to_the_schema(family_dir: Path) -> None:
    engine = engine_for(
        write_tiny_family(family_dir / "mistral.gguf", "mistral"), MISTRAL_ARGS_TEMPLATE
    )
    assert engine.tool_format.style == "mistral_args"
    script(engine, 'Sure.[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}')
    events = generate(engine, AUTO)
    assert events[-1].finish_reason == "tool_calls"
    assert [name for name, _ in _calls(events)] == ["get_weather"]
    assert set(_calls(events)[0][1]) == {"city"}
    assert "".join(e.text for e in events).strip() == "Sure."  # (SentencePiece: " Sure.")


def test_mistral_name_args_required_parses_back(family_dir: Path) -> None:
    engine = engine_for(
        write_tiny_family(family_dir / "mistral-req.gguf", "mistral"), MISTRAL_ARGS_TEMPLATE
    )
    assert engine.tool_format.style == "mistral_args"
    script(engine, "hello")
    required = Constraint("tool_call", tools=(WEATHER,), parallel=True)
    events = generate(engine, dataclasses.replace(AUTO, constraint=required))
    written = engine.tokenizer.decode([t for e in events for t in e.token_ids])
    assert written.startswith("[TOOL_CALLS]get_weather[ARGS]{"), written
    assert events[-1].finish_reason == "tool_calls"
    assert _calls(events) and all(name == "get_weather" for name, _ in _calls(events))
    assert "".join(e.text for e in events) == ""


def test_llama3_several_calls_come_back_each(family_dir: Path) -> None:
    engine = engine_for(
        write_tiny_family(family_dir / "llama3.gguf", "llama3"), LLAMA3_TOOLS_TEMPLATE
    )
    script(
        engine,
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    )
    events = generate(engine, AUTO)
    assert events[-1].finish_reason == "tool_calls"
    assert _calls(events) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert "".join(e.text for e in events) == ""


def test_the_tool_call_format_setting_overrides_the_template(family_dir: Path) -> None:
    """A Mistral file whose template says nothing of tools: `tool_call_format` names it."""
    path = write_tiny_family(family_dir / "mistral-plain.gguf", "mistral")
    assert engine_for(path).tool_format.style == "hermes"
    engine = engine_for(path)
    engine = type(engine)(
        engine.runner,
        engine.tokenizer,
        max_batch=2,
        context=engine.context,
        chat_template=ChatTemplate(tiny_families.MISTRAL_TEMPLATE),
        tool_call_format="mistral",
    )
    assert engine.tool_format.style == "mistral"
    script(engine, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert _calls(generate(engine, AUTO)) == [("get_weather", {"city": "Oslo"})]


def test_the_setting_is_validated(tmp_path: Path) -> None:
    path = tmp_path / "neuron.toml"
    model = '[[default_models]]\nname = "m"\nsource = "builtin:smollm2-135m"\n'
    path.write_text(model + 'tool_call_format = "llama3"\n')
    assert load_config(path, environ={}).default_models[0].tool_call_format == "llama3"
    path.write_text(model + 'tool_call_format = "xml"\n')
    with pytest.raises(ConfigError, match="tool_call_format"):
        load_config(path, environ={})
