"""The chat template's probe render at load: a looping template is refused, in bounded time."""

from __future__ import annotations

import time

import pytest

from neuron_trio.engine.text.chat import ChatTemplate
from neuron_trio.engine.text.chat_probe import probe_chat_template, run_with_deadline
from neuron_trio.errors import ModelFileError
from tests.engine.tiny_gguf import CHATML_TEMPLATE

LOOPING = "{% for a in range(99999) %}{% for b in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"


def test_a_looping_template_is_refused_within_its_time_limit() -> None:
    started = time.monotonic()
    with pytest.raises(ModelFileError, match=r"bad\.gguf: the chat template did not render"):
        probe_chat_template(ChatTemplate(LOOPING), "bad.gguf", time_limit_s=0.3)
    assert time.monotonic() - started < 5  # not the hours the loops would take


def test_a_recursive_template_is_refused() -> None:
    recursive = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    with pytest.raises(ModelFileError, match="RecursionError"):
        probe_chat_template(ChatTemplate(recursive), "deep.gguf")


def test_ordinary_and_refusing_templates_pass(caplog: pytest.LogCaptureFixture) -> None:
    probe_chat_template(ChatTemplate(CHATML_TEMPLATE), "ok.gguf")
    probe_chat_template(ChatTemplate(None), "base.gguf")  # a base model: nothing to probe
    picky = "{{ raise_exception('only one message, please') }}"
    probe_chat_template(ChatTemplate(picky), "picky.gguf")
    assert "only one message" in caplog.text


def test_run_with_deadline_restores_the_previous_tracer() -> None:
    import sys

    before = sys.gettrace()
    assert run_with_deadline(lambda: 41 + 1, 1.0) == 42
    assert sys.gettrace() is before
