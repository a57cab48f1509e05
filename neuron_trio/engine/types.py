"""Plain data shared by the engine and its drivers (service layer, benchmarks, tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ToolFunction:
    """A function the model may call: its name, description and JSON Schema of arguments."""

    name: str
    description: str = ""
    parameters: str = '{"type":"object"}'  # JSON Schema text (compact, as the client sent it)
    strict: bool = False  # OpenAI's strict mode: objects admit no keys they do not name


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (or made earlier, in a conversation's history)."""

    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire form)


@dataclass(frozen=True)
class Constraint:
    """What the output must be, enforced by a token mask at every step (`engine.text.structured.grammar`).

    "json": JSON valid against `schema` (JSON Schema text; `{"type":"object"}` is OpenAI's
    json_object). "tool_call": a call, in the model's tool-call format, to one of `tools`
    (one function: a named tool_choice) whose arguments validate against its parameters;
    several calls when `parallel`.
    """

    kind: Literal["json", "tool_call"]
    schema: str = ""
    tools: tuple[ToolFunction, ...] = ()
    parallel: bool = False
    strict: bool = False  # "json": OpenAI's strict mode (objects closed unless they say not)
    # Whose compiled grammar this is (the job's prefix-cache salt: its tenant or tenant group,
    # and the client's cache_salt): the grammar cache shares a compile only within one scope,
    # so a fast hit never tells a tenant that another sent the same schema (issue 47).
    scope: bytes | None = None
    # Whose compile it is (the tenant's name): charged to its share of the grammar cache
    # (grammar_cache.GrammarCache). Not part of the key: tenants of one group share a compile.
    owner: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Defaults are OpenAI's: temperature 1, top_p 1, no penalties."""

    # None: the model's configured `default_max_tokens`, if any, else to the end of the
    # context (`Engine.prepare` resolves it: prompt.check_prompt)
    max_tokens: int | None = 256
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1: off (multiplicative, as in transformers)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # besides EOS and the template's end-of-turn
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position when logprobs is on (0..20)
    ignore_eos: bool = False  # benchmarks: always produce max_tokens
    constraint: Constraint | None = None  # structured output: a grammar the tokens must follow
    # Tool calls are parsed out of the output text (and not shown as text) for these.
    tools: tuple[ToolFunction, ...] = ()
    parallel_tool_calls: bool = True  # False: only the first call counts, the rest is text
    n: int = 1  # choices: the prompt is prefilled once, then each choice samples on its own
    # (token id, bias) pairs added to the logits before any other step (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The prompt's own logprobs too (`top_logprobs` alternatives each), on the first event of
    # every choice (`SequenceEvent.prompt_logprobs`): completions' echo with logprobs
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token_id, text, logprob), best first


# The finish reasons of a sequence that ended well; any other is reported as an error (the one
# definition: the HTTP layer's bodies and streams read it through service.api).
GOOD_FINISH_REASONS = ("stop", "length", "tool_calls")


@dataclass
class SequenceEvent:
    """What one engine step produced for one sequence.

    `text` is the new, safe-to-show text (never half a UTF-8 character, never the start of a
    stop string that may still complete). `finish_reason` is set on the sequence's last event:
    "stop" (EOS, end-of-turn or a stop string), "length" (max_tokens), "tool_calls" (a call
    to one of the request's tools), "cancelled", or "error" (then `error` says why).
    """

    seq_id: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    index: int = 0  # which choice (0 .. n-1) of the request
    tool_calls: list[ToolCall] | None = None  # calls completed in this event's text
    reasoning: str = ""  # a thinking model's new thinking (`text` is then its answer's)
    # The request has other choices still running: this event's finish_reason ends only
    # choice `index`, not the request.
    more_choices: bool = False
    # params.prompt_logprobs: one entry per prompt token, on the choice's first event; the
    # first token's logprob is 0.0 here (nothing precedes it: the wire shows null)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class EngineStatistics:
    slots_total: int
    slots_in_use: int
    prefilling: int
    decoding: int
    steps: int
    prompt_tokens_total: int  # tokens prefilled (computed: cached prefixes not counted)
    generated_tokens_total: int
    kv_blocks_total: int = 0  # KV pool blocks sequences may use
    kv_blocks_used: int = 0  # ... held by running sequences
    kv_blocks_cached: int = 0  # ... held by no one but a cached prefix (evictable)
    prefix_cache_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_tokens: int = 0  # ... found there (not computed again)
    preemptions: int = 0  # sent back to prefill: the pool ran out, or parked for a lighter tenant
    speculative_proposed_tokens: int = (
        0  # draft tokens verified (engine/speculation/speculative.py)
    )
    speculative_accepted_tokens: int = 0  # ... that the model agreed with (kept)
