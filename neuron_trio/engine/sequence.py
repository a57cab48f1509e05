"""One request's life inside the engine: its prompt, its KV blocks, how far it has got.

A sequence is prefilled first (its prompt written into its KV blocks, a chunk per step),
then decoded (one token per step) until it finishes. A sequence preempted when the KV pool ran
out is prefilled again, over its prompt and its output but the last token (which it already
holds, sampled and sent), then decodes on. Derived counts are properties, so the scheduler and
the engine never keep two copies of the same number.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from neuron_trio.engine.types import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    PREFILLING = "prefilling"  # prompt (or, after preemption, its tokens) not yet all cached
    DECODING = "decoding"  # prompt in the cache, at least one token sampled
    FORKING = "forking"  # another choice of its request prefills the prompt, then it copies
    FINISHED = "finished"  # blocks given back


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    chat: bool = False
    status: SequenceStatus = SequenceStatus.PREFILLING
    prefilled: int = 0  # tokens (of `prefill_len`) already in its KV blocks
    blocks: list[int] = field(default_factory=list)  # its block table, in position order
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    cache_root: bytes | None = None  # block_pool.salt_root of its request's salt: its chain's start
    tenant: str | None = None  # whose request (fair_share.py): preemption and prefill order
    preemptions: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # Per-sequence helpers owned by the engine (sampling state, text pipeline); the
    # scheduler never looks at them.
    sampling: Any = None
    text: Any = None
    tool_calls: Any = None  # a ToolCallParser when the request has tools
    reasoning: Any = None  # a ReasoningSplitter when the model thinks in <think> tags
    # n choices: every choice reports as the request's first sequence (`group_id`) with its
    # `index`; that sequence prefills the prompt and then `forks` share its K/V blocks.
    group_id: int = 0
    index: int = 0
    forks: list[Sequence] = field(default_factory=list)
    # params.prompt_logprobs: the prompt's own logprobs so far (engine/prompt_logprobs.py),
    # sent with the first sampled token
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False
    draft: Any = None  # its speculation's state (speculative.DraftState) once it proposes

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens whose K/V must be cached before the next decode step: the prompt, and after a
        preemption the output so far but its last token (which that step feeds)."""
        return self.num_prompt + max(0, self.num_output - 1)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens `start .. end - 1` of prompt + output."""
        prompt = self.num_prompt
        if end <= prompt:
            return self.prompt_ids[start:end]
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return [*self.prompt_ids[start:], *self.output_ids[: end - prompt]]

    @property
    def last_token(self) -> int:
        """The token a decode step feeds: the last one sampled."""
        return self.output_ids[-1]

    @property
    def decode_pos(self) -> int:
        """The KV position `last_token` is written at by the next decode step."""
        return self.num_prompt + self.num_output - 1

    @property
    def collects_prompt_logprobs(self) -> bool:
        """Its prefill must keep every row's logits (and so reuse no cached prefix)."""
        have = self.prompt_logprobs
        return have is not None and len(have) < self.num_prompt

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
