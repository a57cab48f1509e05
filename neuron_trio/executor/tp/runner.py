"""`TPRunner`: one shard per rank, driven in lockstep on one thread, partial sums all-reduced.

Each rank's model is a TP shard whose `forward_steps(...)` is a generator: at every
row-parallel projection (attention output, MLP down) it yields its partial sum `[B, T, dim]`
and continues with the tensor sent back (the sum over ranks). The runner advances every
rank to its next yield, calls `comm.all_reduce([p_0, …, p_n])` once (one grouped NCCL call
across devices, as NCCL's single-process mode wants), sends each rank its sum, and repeats
until every generator returns its logits; rank 0's come back.

The model never imports a communicator, and this module never looks inside the model.
Blocking: `forward` blocks its (worker) thread for the whole step; a wedged collective
blocks it until the communicator is aborted, then raises CommAbortedError.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace

import torch

from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.engine.model.kv_cache import KVCache
from neuron_trio.engine.model.linear import dense_prefill_rows
from neuron_trio.engine.model.transformer import Transformer
from neuron_trio.errors import CommAbortedError
from neuron_trio.executor.comm import Communicator


class TPRunner:
    """The engine's `Runner` over `len(models)` tensor-parallel ranks."""

    def __init__(
        self,
        models: list[Transformer],
        comm: Communicator,
        *,
        blocks: int,
        context: int,
        config: LlamaConfig | None = None,
    ) -> None:
        if len(models) != comm.world_size:
            raise ValueError(f"{len(models)} rank models for a communicator of {comm.world_size}")
        self.models = models
        self.comm = comm
        self.tp = len(models)
        self.blocks = blocks
        self.context = context
        shard_config: LlamaConfig = models[0].config
        # The whole model's shape (what the scheduler sees), unless given.
        self.config = config or replace(
            shard_config,
            n_heads=shard_config.n_heads * self.tp,
            n_kv_heads=shard_config.n_kv_heads * self.tp,
            ffn_dim=shard_config.ffn_dim * self.tp,
        )
        self.devices = [m.device for m in models]
        self.device = self.devices[0]
        rows = [r for m in models if (r := dense_prefill_rows(m)) is not None]
        self.dense_prefill_rows = min(rows, default=None)
        self.kv = [
            # Each rank's pool holds its own KV heads, in the same blocks (one block table for
            # every rank); K and V are stored in what the model computes them in.
            KVCache.allocate(m.config, blocks, m.act_dtype, d)
            for m, d in zip(models, self.devices, strict=True)
        ]
        for model in models[1:]:
            # Only rank 0's logits come back: the other ranks skip the (replicated) output
            # head, a vocabulary-sized matrix-vector product each per token.
            model.output = _NoLogits()
        for model in models:
            model.init_rope(context)  # RoPE tables for the whole context, once
        self.steps = 0

    def rebind(self, comm: Communicator) -> None:
        """Use a re-created communicator from the next forward on."""
        if comm.world_size != self.tp:
            raise ValueError(f"communicator of {comm.world_size} ranks for tp = {self.tp}")
        self.comm = comm

    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        tables: torch.Tensor,
        *,
        lengths: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        with torch.inference_mode():
            return self._forward(
                input_ids, start_pos, tables, lengths=lengths, all_logits=all_logits
            )

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        with torch.inference_mode():
            for kv in self.kv:
                kv.copy_blocks(src, dst)

    def _forward(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        tables: torch.Tensor,
        *,
        lengths: torch.Tensor | None,
        all_logits: bool,
    ) -> torch.Tensor:
        gens: list[Generator[torch.Tensor, torch.Tensor, torch.Tensor]] = [
            model.forward_steps(
                input_ids.to(device),
                start_pos,  # host tensors: the model reads them to place rows (no GPU sync)
                tables,
                kv,
                lengths=lengths,
                all_logits=all_logits,
            )
            for model, device, kv in zip(self.models, self.devices, self.kv, strict=True)
        ]
        comm = self.comm
        try:
            sums: list[torch.Tensor | None] = [None] * self.tp
            while True:
                partials: list[torch.Tensor] = []
                results: list[torch.Tensor] = []
                for gen, value in zip(gens, sums, strict=True):
                    try:
                        partial = next(gen) if value is None else gen.send(value)
                    except StopIteration as stop:
                        results.append(stop.value)
                    else:
                        partials.append(
                            partial if partial.is_contiguous() else partial.contiguous()
                        )
                if results:
                    if partials:
                        raise RuntimeError("TP ranks out of lockstep: some returned, some yielded")
                    break
                comm.all_reduce(partials)  # in place: each now holds the sum
                sums = list(partials)
        finally:
            for gen in gens:
                gen.close()
        if comm.aborted:
            # NCCL aborted while kernels ran: the logits may be garbage.
            raise CommAbortedError("communicator aborted during the step")
        self.steps += 1
        return results[0]


class _NoLogits(torch.nn.Module):
    """The output head of ranks whose logits are discarded: `[..., dim]` -> `[..., 0]`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], 0)
