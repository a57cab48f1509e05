"""The seam between the scheduler and the model: one forward pass over a batch of rows.

`SingleRunner` (engine/model/load/loader.py, written with the model) drives one unsharded model; the parallel layer's
`TPRunner` drives one shard per rank and all-reduces their partial sums. The scheduler only
sees this protocol, so batching never depends on how the model is split. Block tables are
computed once, by the engine, and are the same for every rank.
"""

from __future__ import annotations

from typing import Protocol

import torch

from neuron_trio.engine.gguf.llama_config import LlamaConfig


class Runner(Protocol):
    config: LlamaConfig  # the whole model's shape (not a shard's)
    blocks: int  # KV pool blocks, the reserved ones (block_pool.RESERVED_BLOCKS) included
    context: int  # positions a row may reach
    device: torch.device  # where logits come back
    # the fewest rows at which a forward takes a projection's dense copy (None: no copies):
    # linear.dense_prefill_rows, for the warm-up
    dense_prefill_rows: int | None

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64: decode rows (T == 1) or prompt chunks
        start_pos: torch.Tensor,  # [B] int64: position of input_ids[:, 0] in each row
        tables: torch.Tensor,  # [B, W] int64: each row's KV blocks in position order (host)
        *,
        lengths: torch.Tensor | None = None,  # [B] int64: real tokens per row, the rest padding
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Write the rows' K/V (not the padding) into their blocks; return float32 logits.

        [B, V] for the last real token of each row, or [B, T, V] with all_logits.
        """
        ...

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy K/V block `src[i]` into `dst[i]` (every layer, every rank's pool)."""
        ...
