"""A request's prompt made ready for `Engine.add`, in one call: template, tokenise, grammar,
validate.

`prepare_prompt` touches only the tokenizer, the chat template and the grammar cache (never
the engine's sequences or blocks), so the service layer may run it on another thread beside a
step; the result is the token ids `add` takes, and whether they are a chat's.

The steps themselves, which `Engine`'s methods of the same purpose call with its state:
the chat template for a tokenizer, a chat rendered (tools as text where the template knows
none), text encoded, and the rules a request must pass before any work (`check_request`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from neuron_trio.engine.block_pool import BLOCK_TOKENS, blocks_for
from neuron_trio.engine.text.chat import ChatTemplate
from neuron_trio.engine.text.chat_literals import ChatPrompt
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.text.tool_calls import render_tools_as_text, template_tools
from neuron_trio.engine.types import Constraint, SamplingParams, ToolFunction
from neuron_trio.errors import ContextLengthError, RequestError


class PromptEngine(Protocol):
    """What prompt preparation needs of an engine (`engine.Engine` has it)."""

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[ToolFunction] = (),
        template_kwargs: Mapping[str, Any] | None = None,
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
    template_kwargs: Mapping[str, Any] | None = None,
) -> PreparedPrompt:
    """The token ids of one request's prompt, given as exactly one of `ids` (used as they
    are), `messages` (a chat, rendered with the model's template and `params.tools`) or
    `text` (a raw completion; None is the empty prompt).

    A request's constraint is compiled here (then cached, so `add` finds it), except with
    `ids`, which `add` compiles, and unless `compile_constraint` is False (the model actor
    compiles on a thread of its own first, `service/grammar_compiles.py`). Raises RequestError (ContextLengthError) if the request
    cannot run: a template that refuses the messages, an invalid schema, a prompt too long.
    `template_kwargs`: more names for the chat template (`chat_template_kwargs`).
    """
    if ids is not None:
        prepared = PreparedPrompt(list(ids), chat=False)
    else:
        if params.constraint is not None and compile_constraint:
            engine.compile_constraint(params.constraint)  # cached for `add`
        if messages is not None:
            if template_kwargs:
                rendered = engine.render_chat(messages, params.tools, template_kwargs)
            else:
                rendered = engine.render_chat(messages, params.tools)
            prepared = PreparedPrompt(engine.encode_prompt(rendered, chat=True), chat=True)
        else:
            prepared = PreparedPrompt(engine.encode_prompt(text or "", chat=False), chat=False)
    engine.validate(prepared.ids, params)
    return prepared


def chat_template_for(tokenizer: Tokenizer, source: str | None) -> ChatTemplate:
    """The chat template `source` (None: the model's own) with the tokenizer's BOS, EOS and
    special tokens' texts."""
    return ChatTemplate(
        source or tokenizer.chat_template,
        bos_token=_token_text(tokenizer, tokenizer.bos_id),
        eos_token=_token_text(tokenizer, tokenizer.eos_id),
        literal_tokens=[_token_text(tokenizer, i) for i in sorted(tokenizer.special_ids)],
    )


def render_messages(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: Sequence[ToolFunction] = (),
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat template applied to `messages` (and `tools`), ending with the assistant's
    turn opening. A template that knows no tools gets them, and the history's calls and
    results, as text (`tool_calls.render_tools_as_text`).

    RequestError (param "messages") if the model has no template or it refuses them.
    """
    source = template.source or ""
    has_tool_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if (tools or has_tool_history) and "tool" not in source:
        messages = render_tools_as_text(messages, tools)
        tools = ()
    extra: dict[str, Any] = {"tools": template_tools(tools)} if tools else {}
    # a ChatPrompt (a str), which says where the messages' control-token strings are
    return template.render(messages, add_generation_prompt=True, variables=template_kwargs, **extra)


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`; BOS is added when the model wants it and the text lacks it.

    Special tokens written in the text (a chat template's) are parsed as such, except,
    in a rendered chat (`ChatPrompt`), those that came from the messages: text.
    """
    if isinstance(text, ChatPrompt) and text.literal_spans:
        ids = tokenizer.encode_chat(text, text.literal_spans)
    else:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_batch: int,
    context: int,
    pool_blocks: int,
) -> None:
    """Refuse, before any work, a request that cannot run (RequestError, ContextLengthError):
    for a model of `vocab_size` tokens, `max_batch` slots, `context` tokens per sequence and
    a KV pool of `pool_blocks` blocks."""
    if not prompt_ids:
        raise RequestError("the prompt is empty", param="prompt")
    if params.max_tokens is not None and params.max_tokens < 1:
        raise RequestError(
            f"max_tokens must be at least 1, got {params.max_tokens}", param="max_tokens"
        )
    for t, _bias in params.logit_bias:
        if not 0 <= t < vocab_size:
            raise RequestError(
                f"logit_bias: token id {t} is outside the vocabulary (0..{vocab_size - 1})",
                param="logit_bias",
            )
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
            param="prompt",
        )
    for t in params.stop_token_ids:
        if not 0 <= t < vocab_size:
            raise RequestError(
                f"stop token id {t} is outside the vocabulary", param="stop_token_ids"
            )
    if not 1 <= params.n <= max_batch:
        raise RequestError(
            f"n must be between 1 and this model's {max_batch} slots, got {params.n}",
            param="n",
        )
    max_tokens = params.max_tokens
    if max_tokens is None:  # to the end of the context
        max_tokens = answer_room(len(prompt_ids), context=context, pool_blocks=pool_blocks)
        if max_tokens < 1:
            raise ContextLengthError(
                f"this model's context is {context} tokens; the prompt has "
                f"{len(prompt_ids)}, which leaves no room for an answer",
                param="messages",
            )
    needed = len(prompt_ids) + max_tokens
    if needed > context:
        raise ContextLengthError(
            f"this model's context is {context} tokens; the prompt has "
            f"{len(prompt_ids)} and max_tokens is {max_tokens} ({needed} in all)"
        )
    # A sequence must fit in the KV pool alone: then the oldest always progresses
    # (younger ones are preempted for it), and nothing is refused half-way.
    capacity = pool_blocks * BLOCK_TOKENS
    if blocks_for(needed) > pool_blocks:
        raise ContextLengthError(
            f"this model's KV cache (kv_cache_mb) holds {capacity} tokens; the prompt has "
            f"{len(prompt_ids)} and max_tokens is {max_tokens} ({needed} in all)"
        )


def answer_room(prompt_tokens: int, *, context: int, pool_blocks: int) -> int:
    """The most tokens an answer to a prompt of `prompt_tokens` may have: to the end of the
    context, or of the KV pool when it holds less (a sequence must fit it alone)."""
    return min(context, pool_blocks * BLOCK_TOKENS) - prompt_tokens


def _token_text(tokenizer: Any, token_id: int | None) -> str:
    if token_id is None:
        return ""
    return str(tokenizer.token_text(token_id))
