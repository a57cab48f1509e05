"""Benchmarks address KV rows by slot, as before the paged cache: slot s owns the consecutive
blocks RESERVED_BLOCKS + s · blocks_for(context) onwards (a copy-free slice each)."""

from __future__ import annotations

import torch

from neuron_trio.engine.block_pool import RESERVED_BLOCKS, blocks_for
from neuron_trio.engine.loader import SingleRunner
from neuron_trio.engine.model import Transformer


class SlotRunner(SingleRunner):
    """A SingleRunner whose `forward` takes each row's slot `[B]` instead of its block table."""

    def __init__(self, model: Transformer, *, slots: int, context: int) -> None:
        self.per_slot = blocks_for(context)
        super().__init__(model, blocks=RESERVED_BLOCKS + slots * self.per_slot, context=context)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        slots: torch.Tensor,
        *,
        lengths: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        first = RESERVED_BLOCKS + slots[:, None] * self.per_slot
        tables = first + torch.arange(self.per_slot)[None, :]
        return super().forward(input_ids, start_pos, tables, lengths=lengths, all_logits=all_logits)
