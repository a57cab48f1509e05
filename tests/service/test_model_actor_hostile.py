"""The model actor against hostile model files (issue 25, findings 2, 5 and 8): a native panic
while loading, a load that never ends, a chat template that loops on one request.

Real worker threads (the code under test runs on them); no timing is asserted: the deadlines
are short so that the tests are, and each waits on an event rather than a sleep.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio

from neuron_trio.config import ModelConfig
from neuron_trio.engine.text.template_sandbox import TemplateLimitError
from neuron_trio.engine.types import SamplingParams
from neuron_trio.errors import ModelFileError, ModelLoadError
from neuron_trio.service.api import ChatMessage, GenerationJob
from neuron_trio.service.model_actor import ModelActor
from tests.engine.native_panic import make_panic

from .fakes import FakeEngine, FakeExecutor


def spec() -> ModelConfig:
    return ModelConfig(name="m", source="m.gguf", max_batch=2)


def chat(*contents: str) -> GenerationJob:
    messages = tuple(ChatMessage("user", c) for c in contents)
    return GenerationJob(model="m", params=SamplingParams(max_tokens=2), messages=messages)


def test_a_native_panic_while_loading_is_a_model_file_error() -> None:
    panic = make_panic()

    def loader() -> FakeExecutor:
        raise panic

    async def main() -> None:
        actor = ModelActor(spec(), loader, max_queue=1)
        async with trio.open_nursery() as nursery:
            # before: the PanicException (a BaseException) went through and ended the process
            with pytest.raises(ModelFileError, match="model 'm': a native library panicked"):
                await nursery.start(actor.run)
        assert actor.state == "unloaded"

    trio.run(main)


def test_a_native_panic_in_warm_up_is_a_model_file_error_and_the_executor_closes() -> None:
    executor = FakeExecutor()
    executor.fail_next_warm_up = make_panic()  # type: ignore[assignment]

    async def main() -> None:
        actor = ModelActor(spec(), lambda: executor, max_queue=1)
        async with trio.open_nursery() as nursery:
            with pytest.raises(ModelFileError, match="a native library panicked"):
                await nursery.start(actor.run)
        assert actor.state == "unloaded" and executor.closed

    trio.run(main)


def test_a_load_past_load_timeout_s_fails_and_its_late_executor_is_closed() -> None:
    release = threading.Event()
    executor = FakeExecutor()

    def loader() -> FakeExecutor:
        release.wait(30)
        return executor

    async def main() -> None:
        actor = ModelActor(spec(), loader, max_queue=1, load_timeout_s=0.2)
        try:
            async with trio.open_nursery() as nursery:
                with pytest.raises(
                    ModelLoadError, match=r"longer than 0\.2 s \(node\.load_timeout_s\)"
                ):
                    await nursery.start(actor.run)
        finally:
            release.set()
        assert actor.state == "unloaded"

    trio.run(main)
    for _ in range(100):  # the abandoned build finishes on its own thread, then is closed
        if executor.closed:
            break
        threading.Event().wait(0.05)
    assert executor.closed


class LoopingTemplateEngine(FakeEngine):
    """A template that "loops" on 4-message chats: its render waits until the test releases
    it, then fails as the real render's deadline does (TemplateLimitError)."""

    def __init__(self) -> None:
        super().__init__(max_batch=2)
        self.release = threading.Event()
        self.render_started = threading.Event()

    def render_chat(self, messages: list[dict[str, Any]], tools: Any = ()) -> str:
        if len(messages) == 4:
            self.render_started.set()
            self.release.wait(30)
            raise TemplateLimitError("the model's chat template did not render these messages")
        return super().render_chat(messages, tools)


def test_a_looping_template_fails_its_request_alone_and_the_loop_keeps_running() -> None:
    executor = FakeExecutor()
    engine = LoopingTemplateEngine()
    executor.engine = engine

    async def main() -> None:
        actor = ModelActor(spec(), lambda: executor, max_queue=4)
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            outcome: list[BaseException] = []

            async def looping_request() -> None:
                try:
                    async with actor.generate(chat("a", "b", "c", "d")):
                        pass
                except TemplateLimitError as exc:
                    outcome.append(exc)

            nursery.start_soon(looping_request)
            await trio.to_thread.run_sync(engine.render_started.wait, 30)
            # The template is "looping" on its worker thread; the event loop is free: another
            # request on the same model completes meanwhile (before: the render ran inline).
            async with actor.generate(chat("hello")) as events:
                texts = [event.text async for event in events]
            assert texts and outcome == []
            engine.release.set()
            while not outcome:
                await trio.sleep(0.01)
            assert isinstance(outcome[0], TemplateLimitError)
            assert actor.state == "serving"
            await actor.unload()

    trio.run(main)
