"""Model tests address KV rows by slot, as before the paged cache: slot s owns a fixed set
of blocks, consecutive (one slice each: the copy-free path) or interleaved with the other
slots' (every read a gather)."""

from __future__ import annotations

from typing import Any

import torch

from neuron_trio.engine.block_pool import BLOCK_TOKENS, RESERVED_BLOCKS, blocks_for
from neuron_trio.engine.model.load.loader import SingleRunner
from neuron_trio.engine.model.transformer import Transformer


def slot_pool_blocks(slots: int, context: int) -> int:
    """Blocks of a pool holding `slots` rows of `context` tokens, reserved blocks included."""
    return RESERVED_BLOCKS + slots * blocks_for(context)


def slot_table(slot: int, slots: int, context: int, *, scattered: bool = False) -> list[int]:
    per = blocks_for(context)
    if scattered:  # block i of slot s sits between those of the other slots
        return [RESERVED_BLOCKS + i * slots + slot for i in range(per)]
    return [RESERVED_BLOCKS + slot * per + i for i in range(per)]


def slot_tables(
    slot_ids: torch.Tensor, slots: int, context: int, *, scattered: bool = False
) -> torch.Tensor:
    """Block tables `[B, blocks]` of the rows in `slot_ids` `[B]`."""
    return torch.tensor(
        [slot_table(s, slots, context, scattered=scattered) for s in slot_ids.tolist()]
    )


class SlotRunner(SingleRunner):
    """A SingleRunner whose `forward` takes each row's slot `[B]` instead of its block table."""

    def __init__(
        self,
        model: Transformer,
        *,
        slots: int,
        context: int,
        kv_dtype: torch.dtype | None = None,
        scattered: bool = False,
    ) -> None:
        super().__init__(
            model, blocks=slot_pool_blocks(slots, context), context=context, kv_dtype=kv_dtype
        )
        self.slots = slots
        self.scattered = scattered

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        slots: torch.Tensor,
        *,
        lengths: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        tables = slot_tables(slots, self.slots, self.context, scattered=self.scattered)
        return super().forward(input_ids, start_pos, tables, lengths=lengths, all_logits=all_logits)

    def token_rows(self, slot: int) -> torch.Tensor:
        """The pool's token rows of slot `slot`, in position order."""
        blocks = torch.tensor(slot_table(slot, self.slots, self.context, scattered=self.scattered))
        return (blocks[:, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).reshape(-1)


class SlotRows:
    """Any runner (a TPRunner) whose `forward` takes each row's slot `[B]`, as SlotRunner."""

    def __init__(self, runner: Any, *, slots: int, context: int) -> None:
        self.runner = runner
        self.slots = slots
        self.slot_context = context

    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        slots: torch.Tensor,
        *,
        lengths: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        tables = slot_tables(slots, self.slots, self.slot_context)
        return self.runner.forward(  # type: ignore[no-any-return]
            input_ids, start_pos, tables, lengths=lengths, all_logits=all_logits
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def slot_tp_runner(models: Any, comm: Any, *, slots: int, context: int, **kw: Any) -> Any:
    """A TPRunner over a pool of `slots` rows of `context` tokens, addressed by slot."""
    from neuron_trio.executor.tp.runner import TPRunner

    runner = TPRunner(models, comm, blocks=slot_pool_blocks(slots, context), context=context, **kw)
    return SlotRows(runner, slots=slots, context=context)
