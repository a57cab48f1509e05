"""A request's prompt made ready for `Engine.add`, in one pass: template, tokenise, check.

`prepare_prompt` touches only the tokenizer and the chat template (never the engine's
sequences or blocks), so the service layer may run it (`Engine.prepare`) on another thread
beside a step. Its result is a `PreparedPrompt`: the token ids, whether they are a chat's, and
the sampling parameters with `max_tokens` resolved. Only `check_prompt` makes one, so a
prompt `add` is given has passed the request's rules (`check_request`) against the engine's
limits exactly once, and `add` trusts it.

A constraint's grammar is not compiled here: the service compiles it first on a thread of its
own (`service/requests/grammar_compiles.py`), a tool or test by `Engine.compile_constraint` or at
`add` (the grammar cache holds it from then on).

The steps, each a function of the engine's parts: the chat template for a tokenizer, a chat
rendered (tools as text where the template knows none), text encoded, the rules checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from neuron_trio.engine.block_pool import BLOCK_TOKENS, blocks_for
from neuron_trio.engine.text.chat import ChatTemplate
from neuron_trio.engine.text.chat_literals import ChatPrompt
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.text.tools.tool_calls import render_tools_as_text, template_tools
from neuron_trio.engine.types import SamplingParams, ToolFunction
from neuron_trio.errors import ContextLengthError, RequestError

# Held by `check_prompt` alone: a PreparedPrompt made anywhere else is refused (TypeError).
_CHECKED = object()


@dataclass(frozen=True)
class PromptLimits:
    """What a request is checked against: an engine's vocabulary, slots (`max_batch`),
    effective context and KV pool (in blocks of BLOCK_TOKENS)."""

    vocab_size: int
    max_batch: int
    context: int
    pool_blocks: int


@dataclass(frozen=True, eq=False)
class PreparedPrompt:
    """A prompt that passed `check_prompt`: its token ids, whether a chat template rendered
    them (its end-of-turn tokens then stop the answer) and its sampling parameters, with
    `max_tokens` resolved (never None). Made by `check_prompt` only; `Engine.add` trusts it."""

    ids: tuple[int, ...]
    chat: bool
    params: SamplingParams
    _checked: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self._checked is not _CHECKED:
            raise TypeError("a PreparedPrompt is made by check_prompt (Engine.prepare) only")


def prepare_prompt(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    limits: PromptLimits,
    params: SamplingParams,
    *,
    text: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    ids: Sequence[int] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    default_max_tokens: int = 0,
) -> PreparedPrompt:
    """One request's prompt, given as exactly one of `ids` (used as they are), `messages` (a
    chat, rendered with `template` and `params.tools`, and `template_kwargs`: the request's
    `chat_template_kwargs`) or `text` (a raw completion; None is the empty prompt), encoded
    and checked (`check_prompt`, which `default_max_tokens` goes to).

    Raises RequestError (ContextLengthError) if the request cannot run: a template that
    refuses the messages, a token id outside the vocabulary, a prompt too long.
    """
    if ids is not None:
        prompt_ids, chat = list(ids), False
    elif messages is not None:
        rendered = render_messages(template, messages, params.tools, template_kwargs)
        prompt_ids, chat = encode_text(tokenizer, rendered), True
    else:
        prompt_ids, chat = encode_text(tokenizer, text or ""), False
    return check_prompt(
        prompt_ids, params, chat=chat, limits=limits, default_max_tokens=default_max_tokens
    )


def check_prompt(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    chat: bool,
    limits: PromptLimits,
    default_max_tokens: int = 0,
) -> PreparedPrompt:
    """`prompt_ids` checked against `limits` (`check_request`), as a PreparedPrompt.

    A `max_tokens` of None becomes `default_max_tokens` (the model's configured default; 0:
    none) cut to the room the prompt leaves an answer, or that room itself: to the end of the
    effective context or of the KV pool, whichever is nearer (`answer_room`). Either fits,
    since the check found room for at least one token.
    """
    ids = list(prompt_ids)
    check_request(
        ids,
        params,
        vocab_size=limits.vocab_size,
        max_batch=limits.max_batch,
        context=limits.context,
        pool_blocks=limits.pool_blocks,
    )
    if params.max_tokens is None:
        room = answer_room(len(ids), context=limits.context, pool_blocks=limits.pool_blocks)
        max_tokens = min(default_max_tokens, room) if default_max_tokens > 0 else room
        params = replace(params, max_tokens=max_tokens)
    return PreparedPrompt(tuple(ids), chat, params, _CHECKED)


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
