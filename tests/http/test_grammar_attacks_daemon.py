"""Schemas that crashed or broke a real `neuron serve` (issue 25 finding 1, issue 26 item 2),
against the built-in model: a 400 naming the field, the process alive, /health 200; and a
nested pydantic tool through the official client."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.neuron_process import builtin_daemon, skip_without_builtin_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
CONST_30K = {"const": {f"k{i}": i for i in range(30_000)}}  # ~480 KB: a SIGSEGV before


class Daemon:
    def __init__(self, url: str, proc: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.proc = proc

    def assert_unharmed(self) -> None:
        assert self.proc.poll() is None, "the daemon died"
        assert httpx.get(f"{self.url}/health", timeout=5).status_code == 200


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    skip_without_builtin_model()
    with builtin_daemon(tmp_path_factory.mktemp("grammar-attacks")) as (url, proc):
        yield Daemon(url, proc)


def _chat(daemon: Daemon, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return httpx.post(f"{daemon.url}/v1/chat/completions", json={**body, **extra}, timeout=120)


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "\n" not in error["message"]
    return dict(error)


def test_a_30k_key_const_schema_is_a_400_and_the_node_lives_on(daemon: Daemon) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": CONST_30K},
    }
    assert len(json.dumps(response_format)) > 400_000
    error = _error(_chat(daemon, response_format=response_format))
    assert error["message"].startswith("response_format.json_schema.schema: ")
    assert "SchemaLimits." in error["message"]
    daemon.assert_unharmed()


def test_the_same_schema_as_tool_parameters_too(daemon: Daemon) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": CONST_30K}}]
    choice = {"type": "function", "function": {"name": "f"}}
    error = _error(_chat(daemon, tools=tools, tool_choice=choice))
    assert error["message"].startswith("tools[f].function.parameters: ")
    daemon.assert_unharmed()


def test_an_unsupported_feature_is_one_line_naming_it(daemon: Daemon) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    error = _error(_chat(daemon, response_format=response_format))
    assert "$ref https://example.com/a.json is not supported" in error["message"]
    daemon.assert_unharmed()


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str | None = Field(max_length=20)


class Person(BaseModel):
    name: str = Field(max_length=20)
    home: Address


def test_pydantic_function_tool_with_a_nested_model(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", timeout=300, max_retries=0)
    tool = openai.pydantic_function_tool(Person, name="save_person")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Save Ada Lovelace, who lives in London."}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "save_person"}},
        temperature=0,
        max_tokens=120,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "save_person"
    Person.model_validate_json(calls[0].function.arguments)  # the nested model validates
    daemon.assert_unharmed()
