"""A model's chat template, tried once at load on a small conversation, under a time limit.

The template is code from the model file. The sandbox stops it from touching anything, and
`template_sandbox` bounds what one render may cost, but a template may still loop:
`{% for a in range(99999) %}{% for b in range(99999) %}` renders for hours. So before a model
is accepted its template renders a probe conversation with a deadline (`ChatTemplate.render`'s,
enforced by a trace function on the rendering thread). A template that runs past the deadline,
exceeds a bound or blows up (recursion, memory), or does not compile at all within its size
bound, is a ModelFileError: 422 at run time, exit 69 for a default model. A template that
merely refuses the probe with its own `raise_exception` is only logged: some templates reject
conversations they do not expect, and the model still serves /v1/completions.

The probe cannot prove a template harmless (one may loop only on 4-message chats): every
request's render has the same bounds, and fails alone (a 500) if it exceeds them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from neuron_trio.engine.text.chat import ChatTemplate
from neuron_trio.engine.text.template_sandbox import TemplateLimitError, run_with_deadline
from neuron_trio.errors import ModelFileError, RequestError

__all__ = [
    "PROBE_TIME_LIMIT_S",
    "probe_chat_template",
    "probe_gguf_chat_template",
    "run_with_deadline",
]

log = logging.getLogger(__name__)

PROBE_TIME_LIMIT_S = 2.0
PROBE_CONVERSATION = (
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "What is the capital of France?"},
)


def probe_chat_template(
    template: ChatTemplate, source: str | Path, time_limit_s: float = PROBE_TIME_LIMIT_S
) -> None:
    """Render PROBE_CONVERSATION; ModelFileError (naming `source`) if the template loops past
    `time_limit_s` or fails in a way no input justifies. No template: nothing to probe."""
    if not template.available:
        if template.source is not None and "compile" in (template.error or ""):
            log.warning("%s: %s", source, template.error)
        return
    try:
        template.render(list(PROBE_CONVERSATION), time_limit_s=time_limit_s)
    except RequestError as exc:  # the template's own refusal, or a render error it reports
        log.warning("%s: the chat template refused a probe conversation: %s", source, exc)
    except TemplateLimitError as exc:
        raise ModelFileError(
            f"{source}: the chat template did not render a three-message conversation: {exc.message}"
        ) from None


def probe_gguf_chat_template(path: Path, source: str) -> None:
    """Read `path`'s chat template from its header and probe it (blocking: a worker thread)."""
    from neuron_trio.engine.gguf.file import GGUFFile

    with GGUFFile(path) as gguf:
        text = gguf.metadata.get("tokenizer.chat_template")
    if isinstance(text, str):
        probe_chat_template(ChatTemplate(text), source)
