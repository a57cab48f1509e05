"""How big a model is before it is loaded: the KV pool's blocks and bytes, the engine's
context cap (`engine_sizing`, the one computation the engine and the executor's builders
share), and the bytes its weights take under a dtype (service/placement.py places models by
these before loading them).

The estimates follow `loader.load_transformer`'s storage choices (its schemes and formats);
a change there is a change here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.engine.model.kv_cache import KVCache
from neuron_trio.engine.model.load import loader, packing
from neuron_trio.engine.model.load.loader import (
    FOUR_BIT,
    block_rows,
    quantized_rows_fit,
    resolve_dtype,
    scheme_dtypes,
)
from neuron_trio.errors import ConfigError


def kv_dtype_for(dtype: str, device: torch.device | str) -> torch.dtype:
    """The dtype a runner keeps K/V in for the weights' `dtype` on `device` (its activations')."""
    act, _ = scheme_dtypes(resolve_dtype(dtype, torch.device(device)))
    return act


def kv_pool_blocks(
    config: LlamaConfig,
    dtype: str,
    device: torch.device | str,
    *,
    kv_cache_mb: int,
    max_batch: int,
    context: int,
) -> int:
    """Blocks of the KV pool a model's config asks for (reserved ones included): `kv_cache_mb`
    MiB of K/V in the activation dtype, or with 0, `max_batch` × `context` tokens' worth
    (`context` capped at the model's own). ConfigError if the budget holds no block."""
    try:
        return KVCache.blocks_for_budget(
            config,
            kv_dtype_for(dtype, device),
            budget_mb=kv_cache_mb,
            max_batch=max_batch,
            context=min(context, config.context_length),
        )
    except ValueError as exc:
        raise ConfigError(f"kv_cache_mb: {exc}") from None


@dataclass(frozen=True)
class EngineSizing:
    """How big one loaded model's engine is: the one computation every builder shares."""

    context: int  # tokens per sequence: as configured, capped at the model's own
    kv_blocks: int  # the KV pool (reserved blocks included), the same on every TP rank


def engine_sizing(
    config: LlamaConfig,
    dtype: str,
    device: torch.device | str,
    *,
    kv_cache_mb: int,
    max_batch: int,
    context: int,
) -> EngineSizing:
    """The context cap and the KV pool's blocks (`kv_pool_blocks`) of a model's engine.

    The pool follows the whole model's shape: every TP rank holds all its blocks, each for its
    own KV heads (so each rank holds 1/tp of kv_cache_mb).
    """
    capped = min(context, config.context_length)
    blocks = kv_pool_blocks(
        config, dtype, device, kv_cache_mb=kv_cache_mb, max_batch=max_batch, context=capped
    )
    return EngineSizing(context=capped, kv_blocks=blocks)


def estimate_kv_bytes(
    config: LlamaConfig,
    dtype: str,
    device: torch.device | str,
    *,
    kv_cache_mb: int,
    max_batch: int,
    context: int,
) -> int:
    """Bytes of the KV pool (`kv_pool_blocks`), as a runner reserves it."""
    blocks = kv_pool_blocks(
        config, dtype, device, kv_cache_mb=kv_cache_mb, max_batch=max_batch, context=context
    )
    return KVCache.bytes_needed(config, blocks, kv_dtype_for(dtype, device))


def estimate_weight_bytes(gf: GGUFFile, dtype: str, device: torch.device | str) -> int:
    """Bytes the weights of `gf` take on `device` under `dtype`, as `load_transformer` stores
    them (int copies, dense copies and tables included), for the whole unsharded model."""
    c = gf.config
    scheme = resolve_dtype(dtype, torch.device(device))
    act, _ = scheme_dtypes(scheme)
    native = torch.device(device).type == "cpu" and packing.native_kernel() is not None
    # the bfloat16 copy of a projection: torch's kernels always, the native one's maybe (a
    # weight beyond float16's range that falls back to torch's int4 is not foreseen here)
    copy = 2 if not native or packing.native_dense_copies() else 0
    total = 0
    for name, info in gf.tensors.items():
        n = info.n_elements
        if scheme != "cpu-int" or len(info.shape) == 1:
            size = 4 if name.endswith("norm.weight") else torch.empty((), dtype=act).element_size()
            total += n * size
        elif name == "output.weight":  # the coarse pass + its table (the file's blocks or float32)
            blocks = block_rows(gf, name, c.dim)
            total += _coarse_head_bytes(n, c.vocab_size) + (info.nbytes if blocks else 4 * n)
        elif (
            name == "token_embd.weight"
            and quantized_rows_fit(gf, c.dim)
            and (not c.tied_output or block_rows(gf, name, c.dim))
        ):  # tied: the file's blocks, the head's table too (QuantizedEmbedding); untied:
            # read from the file a step's rows at a time (FileEmbedding), nothing held
            if c.tied_output:
                total += info.nbytes + _coarse_head_bytes(n, c.vocab_size)
        elif name == "token_embd.weight":  # float32 table (+ the tied head's coarse pass)
            total += n * 4 + (_coarse_head_bytes(n, c.vocab_size) if c.tied_output else 0)
        elif info.qtype in FOUR_BIT:  # int4 + its scales (and minimums) + bf16 dense copy
            scales = 4  # float16 scale and minimum (native), or bfloat16 scale and zero (torch)
            total += n // 2 + n // packing.INT4_GROUP * scales + copy * n
        elif info.qtype in quant.FIVE_BIT and native:  # nibbles, fifth bits, scales, dense
            total += n // 2 + n // 8 + n // packing.INT4_GROUP * 4 + copy * n
        elif native:  # int8 + float32 row scales + int32 group sums + bf16 dense copy
            total += n + 4 * info.shape[0] + n // packing.INT4_GROUP * 4 + copy * n
        else:  # int8 + bf16 scales + bf16 dense copy
            total += n + 2 * info.shape[0] + 2 * n
    return total


def _coarse_head_bytes(n: int, vocab: int) -> int:
    """Bytes of RefinedHead's coarse pass over `n` weights: int4 + scales/zeros, or int8 +
    scales (+ the native kernel's int32 group sums)."""
    if loader.AUTO_INT4_HEAD:  # read at the call: a test switches it
        return n // 2 + n // packing.INT4_GROUP * 4
    return n + 2 * vocab + n // packing.INT4_GROUP * 4
