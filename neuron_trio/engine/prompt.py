"""A request's prompt made ready for `Engine.add`, in one call: template, tokenise, grammar,
validate.

`prepare_prompt` touches only the tokenizer, the chat template and the grammar cache (never
the engine's sequences or blocks), so the service layer may run it on another thread beside a
step; the result is the token ids `add` takes, and whether they are a chat's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from neuron_trio.engine.types import Constraint, SamplingParams, ToolFunction


class PromptEngine(Protocol):
    """What prompt preparation needs of an engine (`engine.Engine` has it)."""

    def render_chat(
        self, messages: list[dict[str, Any]], tools: Sequence[ToolFunction] = ()
    ) -> str: ...
    def compile_constraint(self, constraint: Constraint) -> object: ...
    def encode_prompt(self, text: str, *, chat: bool) -> list[int]: ...
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None: ...


@dataclass(frozen=True)
class PreparedPrompt:
    ids: list[int]
    chat: bool  # rendered by the chat template (its end-of-turn tokens then stop it)


def prepare_prompt(
    engine: PromptEngine,
    params: SamplingParams,
    *,
    text: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    ids: Sequence[int] | None = None,
    compile_constraint: bool = True,
) -> PreparedPrompt:
    """The token ids of one request's prompt, given as exactly one of `ids` (used as they
    are), `messages` (a chat, rendered with the model's template and `params.tools`) or
    `text` (a raw completion; None is the empty prompt).

    A request's constraint is compiled here (then cached, so `add` finds it), except with
    `ids`, which `add` compiles, and unless `compile_constraint` is False (the model actor
    compiles on a thread of its own first, `service/grammar_compiles.py`). Raises RequestError (ContextLengthError) if the request
    cannot run: a template that refuses the messages, an invalid schema, a prompt too long.
    """
    if ids is not None:
        prepared = PreparedPrompt(list(ids), chat=False)
    else:
        if params.constraint is not None and compile_constraint:
            engine.compile_constraint(params.constraint)  # cached for `add`
        if messages is not None:
            rendered = engine.render_chat(messages, params.tools)
            prepared = PreparedPrompt(engine.encode_prompt(rendered, chat=True), chat=True)
        else:
            prepared = PreparedPrompt(engine.encode_prompt(text or "", chat=False), chat=False)
    engine.validate(prepared.ids, params)
    return prepared
