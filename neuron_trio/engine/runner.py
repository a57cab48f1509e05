"""The seam between the scheduler and the model: one forward pass over a batch of rows.

`SingleRunner` (here, written with the model) drives one unsharded model; the parallel layer's
`TPRunner` drives one shard per rank and all-reduces their partial sums. The scheduler only
sees this protocol, so batching never depends on how the model is split.
"""

from __future__ import annotations

from typing import Protocol

import torch

from neuron_trio.engine.llama_config import LlamaConfig


class Runner(Protocol):
    config: LlamaConfig  # the whole model's shape (not a shard's)
    slots: int  # KV cache rows (max_batch)
    context: int  # tokens per slot
    device: torch.device  # where logits come back

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64: decode rows (T == 1) or prompt chunks
        start_pos: torch.Tensor,  # [B] int64: position of input_ids[:, 0] in each row's slot
        slots: torch.Tensor,  # [B] int64: KV cache row of each sequence
        *,
        lengths: torch.Tensor | None = None,  # [B] int64: real tokens per row, the rest padding
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Write the rows' K/V (not the padding) into their slots; return float32 logits.

        [B, V] for the last real token of each row, or [B, T, V] with all_logits.
        """
        ...

    def fork_rows(self, src: int, dsts: list[int], length: int) -> None:
        """Copy slot `src`'s first `length` K/V positions into slots `dsts` (every rank's)."""
        ...
