"""One request's life inside the engine: its prompt, its slot, how far it has got.

A sequence is prefilled first (its prompt written into its slot's KV row, a chunk per step),
then decoded (one token per step) until it finishes. Derived counts are properties, so the
scheduler and the engine never keep two copies of the same number.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from neuron_trio.engine.types import SamplingParams


class SequenceStatus(enum.Enum):
    PREFILLING = "prefilling"  # prompt not yet (fully) in the KV cache
    DECODING = "decoding"  # prompt in the cache, at least one token sampled
    FORKING = "forking"  # another choice of its request prefills the prompt, then it copies
    FINISHED = "finished"  # slot given back


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    chat: bool = False
    slot: int = -1
    status: SequenceStatus = SequenceStatus.PREFILLING
    prefilled: int = 0  # prompt tokens already written into the slot's KV row
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # Per-sequence helpers owned by the engine (sampling state, text pipeline); the
    # scheduler never looks at them.
    sampling: Any = None
    text: Any = None
    tool_calls: Any = None  # a ToolCallParser when the request has tools
    # n choices: every choice reports as the request's first sequence (`group_id`) with its
    # `index`; that sequence prefills the prompt and then `forks` copy its K/V rows.
    group_id: int = 0
    index: int = 0
    forks: list[Sequence] = field(default_factory=list)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def last_token(self) -> int:
        """The token a decode step feeds: the last one sampled."""
        return self.output_ids[-1]

    @property
    def decode_pos(self) -> int:
        """The KV position `last_token` is written at by the next decode step."""
        return self.num_prompt + self.num_output - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
