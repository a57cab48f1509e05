"""A model's chat template, tried once at load on a small conversation, under a time limit.

The template is code from the model file. The sandbox stops it from touching anything, but
not from looping: `{% for a in range(99999) %}{% for b in range(99999) %}` renders for
hours, and would do so on the first chat request. So before a model is accepted its template
renders a probe conversation with a deadline, enforced by a trace function on the rendering
thread (jinja2 compiles templates to Python, so every template line is a trace event). A
template that runs past the deadline, or blows up (recursion, memory), is a ModelFileError:
422 at run time, exit 69 for a default model. A template that merely refuses the probe with
its own `raise_exception` is only logged: some templates reject conversations they do not
expect, and the model still serves /v1/completions.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from neuron_trio.engine.text.chat import ChatTemplate
from neuron_trio.errors import ModelFileError, RequestError

log = logging.getLogger(__name__)

T = TypeVar("T")
PROBE_TIME_LIMIT_S = 2.0
PROBE_CONVERSATION = (
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "What is the capital of France?"},
)


class _PastDeadline(Exception):
    pass


def run_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """`fn()` on this thread, raising TimeoutError once it has run `seconds` (checked at every
    Python line and call it makes; a single long C call is not interrupted)."""
    deadline = time.monotonic() + seconds

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _PastDeadline
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn()
    except _PastDeadline:
        raise TimeoutError(f"still running after {seconds:g} s") from None
    finally:
        sys.settrace(previous)


def probe_chat_template(
    template: ChatTemplate, source: str | Path, time_limit_s: float = PROBE_TIME_LIMIT_S
) -> None:
    """Render PROBE_CONVERSATION; ModelFileError (naming `source`) if the template loops past
    `time_limit_s` or fails in a way no input justifies. No template: nothing to probe."""
    if not template.available:
        return
    try:
        run_with_deadline(lambda: template.render(list(PROBE_CONVERSATION)), time_limit_s)
    except RequestError as exc:  # the template's own refusal, or a render error it reports
        log.warning("%s: the chat template refused a probe conversation: %s", source, exc)
    except TimeoutError as exc:
        raise ModelFileError(
            f"{source}: the chat template did not render a three-message conversation within "
            f"{time_limit_s:g} s ({exc})"
        ) from None
    except (RecursionError, MemoryError, OverflowError) as exc:
        raise ModelFileError(
            f"{source}: the chat template failed on a three-message conversation: "
            f"{type(exc).__name__}"
        ) from None


def probe_gguf_chat_template(path: Path, source: str) -> None:
    """Read `path`'s chat template from its header and probe it (blocking: a worker thread)."""
    from neuron_trio.engine.gguf.file import GGUFFile

    with GGUFFile(path) as gguf:
        text = gguf.metadata.get("tokenizer.chat_template")
    if isinstance(text, str):
        probe_chat_template(ChatTemplate(text), source)
