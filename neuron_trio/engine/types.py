"""Plain data shared by the engine and its drivers (service layer, benchmarks, tests)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Defaults are OpenAI's: temperature 1, top_p 1, no penalties."""

    max_tokens: int = 256
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


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token_id, text, logprob), best first


@dataclass
class SequenceEvent:
    """What one engine step produced for one sequence.

    `text` is the new, safe-to-show text (never half a UTF-8 character, never the start of a
    stop string that may still complete). `finish_reason` is set on the sequence's last event:
    "stop" (EOS, end-of-turn or a stop string), "length" (max_tokens), "cancelled", or
    "error" (then `error` says why).
    """

    seq_id: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class EngineStatistics:
    slots_total: int
    slots_in_use: int
    prefilling: int
    decoding: int
    steps: int
    prompt_tokens_total: int
    generated_tokens_total: int
