"""The chat template stored in a GGUF file (`tokenizer.chat_template`), rendered as transformers does.

Templates come from model files, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment`, bounded in time, value sizes and memory
(`template_sandbox.BoundedSandboxEnvironment`, `render`'s deadline), with the same environment
transformers' `apply_chat_template` sets up (`trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension, `raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML), so that a prompt rendered here is the prompt transformers would build. Control tokens
typed in messages stay text (`chat_literals`): `render` returns a `ChatPrompt` that says where
they are.

Rendering blocks for up to its deadline: the service calls it on a worker thread.

A model without a chat template: `ChatTemplate(None, ...)` is allowed, and `render` raises
RequestError naming `messages` (use /v1/completions with your own prompt). There is no
ChatML fallback on purpose: a base model that was never trained on `<|im_start|>` would answer
nonsense, and silently so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import jinja2
import jinja2.ext

from neuron_trio.engine.text.chat_literals import ChatPrompt, LiteralTokens
from neuron_trio.engine.text.template_sandbox import (
    MAX_JSON_INDENT,
    BoundedSandboxEnvironment,
    TemplateLimitError,
    render_budget,
    run_with_deadline,
)
from neuron_trio.errors import RequestError

# A request's render: ~100 µs for a usual chat, a few ms for hundreds of messages with tools.
RENDER_TIME_LIMIT_S = 5.0

# Tokens that end an assistant's turn in common templates (besides the model's EOS).
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML (SmolLM, Qwen)
    "<|eot_id|>",  # Llama 3
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<EOT>",
    "<end_of_utterance>",
)


class _TokenizerLike(Protocol):
    @property
    def eos_id(self) -> int | None: ...

    def token_to_id(self, text: str) -> int | None: ...


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    if indent is not None and not 0 <= indent <= MAX_JSON_INDENT:
        raise TemplateLimitError(f"tojson's indent {indent} (at most {MAX_JSON_INDENT})")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> BoundedSandboxEnvironment:
    env = BoundedSandboxEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.set_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One model's chat template. `render` turns OpenAI-style messages into the prompt text.

    `template_str` None means the model has none (render raises RequestError). A template that
    does not compile is a RequestError too, raised at render (so loading the model still works
    for /v1/completions) and kept in `error`. `literal_tokens` are the vocabulary's control
    tokens: typed in a message, they are marked to be tokenized as text (`chat_literals`).
    """

    def __init__(
        self,
        template_str: str | None,
        *,
        bos_token: str = "",
        eos_token: str = "",
        extra_context: Mapping[str, Any] | None = None,
        literal_tokens: Sequence[str] = (),
    ) -> None:
        self.source = template_str
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._extra = dict(extra_context or {})
        self._template: jinja2.Template | None = None
        self.error: str | None = None
        if template_str is None:
            self.error = "this model has no chat template: send a prompt to /v1/completions"
        else:
            try:
                self._template = _environment().compile_template(template_str)
            except (jinja2.TemplateError, TemplateLimitError) as e:
                self.error = f"this model's chat template does not compile: {e}"
        # only a template that renders guards them: Gemma 3's 6,414 control tokens' pattern
        # took ~0.045 s of a start whose file has no template
        self._literals = LiteralTokens(literal_tokens if self._template is not None else ())

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
        time_limit_s: float = RENDER_TIME_LIMIT_S,
    ) -> ChatPrompt:
        """The prompt for `messages`; with `add_generation_prompt`, it ends by opening the
        assistant's turn. Role "developer" is passed to the template as "system" (OpenAI's
        newer name for it). RequestError (param "messages") if the template cannot render them:
        none, or the template itself refuses (`raise_exception`), or fails. `variables`: more
        names for the template (a request's `chat_template_kwargs`, e.g. `enable_thinking`),
        never the ones set here. TemplateLimitError
        (500) if it runs past `time_limit_s` or past a size bound (`template_sandbox`).

        Blocking, for up to `time_limit_s`: call it on a worker thread."""
        if self._template is None:
            raise RequestError(self.error or "no chat template", param="messages")
        template = self._template
        plain: list[dict[str, Any]] = [
            {**m, "role": "system"} if m.get("role") == "developer" else dict(m) for m in messages
        ]
        guard = self._literals.guard()
        if guard is not None:
            plain = guard.protect(plain)
            tools = guard.protect(tools)
            variables = guard.protect(variables)
        context: dict[str, Any] = {
            **(variables or {}),
            "tools": tools or None,  # as transformers passes them: `tools is none` holds
            "documents": None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **self._extra,
        }

        def render() -> str:
            with render_budget():
                return template.render(
                    messages=plain, add_generation_prompt=add_generation_prompt, **context
                )

        try:
            text = run_with_deadline(render, time_limit_s)
        except TimeoutError:
            raise TemplateLimitError(
                f"the model's chat template did not render these messages within {time_limit_s:g} s"
            ) from None
        except TemplateLimitError:
            raise
        except jinja2.TemplateError as e:
            raise RequestError(
                f"the model's chat template rejected the messages: {e}", param="messages"
            ) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(
                f"the model's chat template failed on the messages: {type(e).__name__}: {e}",
                param="messages",
            ) from None
        except (RecursionError, MemoryError, OverflowError) as e:
            raise TemplateLimitError(
                f"the model's chat template failed on the messages: {type(e).__name__}"
            ) from None
        return guard.restore(text) if guard is not None else ChatPrompt(text)


def end_of_turn_ids(tokenizer: _TokenizerLike) -> set[int]:
    """The tokens that end the assistant's turn: EOS, and the usual end-of-turn tokens
    (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`...) that the vocabulary has as special tokens."""
    ids: set[int] = set()
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    special = getattr(tokenizer, "special_ids", None)
    for text in END_OF_TURN_TOKENS:
        token_id = tokenizer.token_to_id(text)
        if token_id is not None and (special is None or token_id in special):
            ids.add(token_id)
    return ids
