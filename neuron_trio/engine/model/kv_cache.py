"""The paged KV cache: a pool of blocks of BLOCK_TOKENS positions, the attention memory of
every sequence being served (`block_pool.BlockPool` decides which block holds what).

Per layer one tensor `[2 · n_kv_heads, n_blocks · BLOCK_TOKENS, head_dim]`: the K heads,
then the V heads, head-major, so a sequence whose blocks are consecutive reads its keys as a
plain slice (no copy), and scattered blocks are gathered with one index of token rows
(`block · BLOCK_TOKENS + position % BLOCK_TOKENS`). The pool is sized once, by a memory
budget, and never grows:

    nbytes = 2 · n_layers · n_kv_heads · head_dim · itemsize(dtype) · BLOCK_TOKENS · n_blocks

e.g. the built-in model (30 layers, 3 KV heads of 64, bfloat16) spends 23,040 bytes a token,
368,640 a block; `max_batch` 8 × `context` 4096 is 2,048 blocks + 2 reserved: 755 MB reserved.
The storage comes from `torch.empty`: on CPU the pages are committed only as blocks are first
written, so memory use follows the blocks in use. Only the null block (block 0, what padding
reads) is zeroed up front. `config` is the shard-local shape under tensor parallelism (each
rank holds its own KV heads; every rank's pool has the same blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_trio.engine.block_pool import BLOCK_TOKENS, NULL_BLOCK, RESERVED_BLOCKS
from neuron_trio.engine.gguf.llama_config import LlamaConfig


@dataclass
class KVCache:
    """K and V of every layer: `layers[l]` is `[2 · n_kv_heads, n_blocks · BLOCK_TOKENS, head_dim]`."""

    layers: list[torch.Tensor]
    n_blocks: int  # reserved blocks included
    storage: torch.Tensor  # the one allocation the per-layer views live in

    @staticmethod
    def bytes_per_block(config: LlamaConfig, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layers * config.n_kv_heads * config.head_dim * BLOCK_TOKENS * item

    @classmethod
    def bytes_needed(cls, config: LlamaConfig, n_blocks: int, dtype: torch.dtype) -> int:
        """What `allocate` with these arguments reserves, in bytes."""
        return n_blocks * cls.bytes_per_block(config, dtype)

    @classmethod
    def blocks_for_budget(
        cls,
        config: LlamaConfig,
        dtype: torch.dtype,
        *,
        budget_mb: int,
        max_batch: int,
        context: int,
    ) -> int:
        """Blocks in a pool (reserved ones included) of `budget_mb` MiB, or with 0, of
        enough blocks for `max_batch` sequences of `context` tokens each."""
        if budget_mb > 0:
            usable = (budget_mb << 20) // cls.bytes_per_block(config, dtype) - RESERVED_BLOCKS
        else:
            usable = max_batch * -(-context // BLOCK_TOKENS)
        if usable < 1:
            raise ValueError(
                f"a KV cache of {budget_mb} MiB holds no block of {BLOCK_TOKENS} tokens "
                f"({cls.bytes_per_block(config, dtype)} bytes each, {RESERVED_BLOCKS} reserved)"
            )
        return usable + RESERVED_BLOCKS

    @classmethod
    def allocate(
        cls,
        config: LlamaConfig,
        n_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """An uninitialised pool of `n_blocks` blocks, the null block zeroed."""
        if n_blocks <= RESERVED_BLOCKS:
            raise ValueError(f"a KV cache needs more than {RESERVED_BLOCKS} blocks, got {n_blocks}")
        shape = (config.n_layers, 2 * config.n_kv_heads, n_blocks * BLOCK_TOKENS, config.head_dim)
        storage = torch.empty(shape, dtype=dtype, device=device)
        null = NULL_BLOCK * BLOCK_TOKENS
        storage[:, :, null : null + BLOCK_TOKENS].zero_()
        return cls(layers=list(storage.unbind(0)), n_blocks=n_blocks, storage=storage)

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy each block `src[i]` into `dst[i]`, every layer (a fork's partial last block)."""
        for s, d in zip(src, dst, strict=True):
            s0, d0 = s * BLOCK_TOKENS, d * BLOCK_TOKENS
            self.storage[:, :, d0 : d0 + BLOCK_TOKENS].copy_(
                self.storage[:, :, s0 : s0 + BLOCK_TOKENS]
            )
