"""Per-slot K/V rows: the attention memory of every sequence being served.

One tensor `[n_layers, slots, 2 · n_kv_heads, context, head_dim]` (per layer and slot: the
K heads, then the V heads) is allocated up front, so memory is bounded by `slots × context`
and never grows while serving:

    nbytes = 2 · n_layers · slots · n_kv_heads · context · head_dim · itemsize(dtype)

e.g. the built-in model (30 layers, 3 KV heads of 64) with 9 slots of 4096 tokens in
bfloat16: 2·30·9·3·4096·64·2 = 849 MB (float32: twice that). A slot is a row: a sequence
writes position p of layer l to `layers[l][slot, :, p]` (K and V together, one copy). `config` is the shard-local shape under
tensor parallelism (each rank holds its own KV heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_trio.engine.llama_config import LlamaConfig


@dataclass
class KVCache:
    """K and V of every layer: `layers[l]` is `[slots, 2 · n_kv_heads, context, head_dim]`.

    `k[l]` and `v[l]` are views of its K and V halves, `[slots, n_kv_heads, context, head_dim]`.
    """

    layers: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    slots: int
    context: int
    storage: torch.Tensor  # the one allocation the per-layer views live in

    @staticmethod
    def bytes_needed(config: LlamaConfig, slots: int, context: int, dtype: torch.dtype) -> int:
        """What `allocate` with these arguments takes, in bytes."""
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layers * slots * config.n_kv_heads * context * config.head_dim * item

    @classmethod
    def allocate(
        cls,
        config: LlamaConfig,
        slots: int,
        context: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """Zeroed K/V rows for `slots` sequences of up to `context` tokens each."""
        if slots < 1 or context < 1:
            raise ValueError(f"KV cache needs slots >= 1 and context >= 1, got {slots}, {context}")
        kv = config.n_kv_heads
        storage = torch.zeros(
            (config.n_layers, slots, 2 * kv, context, config.head_dim), dtype=dtype, device=device
        )
        layers = list(storage.unbind(0))
        k = [layer[:, :kv] for layer in layers]
        v = [layer[:, kv:] for layer in layers]
        return cls(layers=layers, k=k, v=v, slots=slots, context=context, storage=storage)

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def copy_prefix(self, src: int, dsts: list[int], length: int) -> None:
        """Copy the first `length` positions of slot `src` into each of `dsts` (n choices of
        one prompt: prefilled once, then forked)."""
        for dst in dsts:
            self.storage[:, dst, :, :length].copy_(self.storage[:, src, :, :length])

    def clear(self, slot: int) -> None:
        """Zero one slot's rows (not needed for correctness: attention masks past a row's end)."""
        self.storage[:, slot].zero_()
