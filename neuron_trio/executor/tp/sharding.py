"""Tensor-parallel sharding rules for Llama-architecture GGUF tensors (Megatron style).

Weights arrive in torch's `[out_features, in_features]` layout (as `F.linear` takes them):

| tensor (GGUF name)                         | split                              |
| ------------------------------------------ | ---------------------------------- |
| `blk.N.attn_q` (+ bias)                    | column-wise: this rank's heads     |
| `blk.N.attn_k`, `blk.N.attn_v` (+ biases)  | column-wise: this rank's KV heads  |
| `blk.N.attn_output`                        | row-wise: input columns of its heads |
| `blk.N.ffn_gate`, `blk.N.ffn_up`           | column-wise: its slice of the FFN  |
| `blk.N.ffn_down`                           | row-wise: input columns of its slice |
| norms, `token_embd`, `output`              | replicated                         |

When `tp` exceeds the KV heads and is a multiple of them, KV heads are replicated (as vLLM
does): each rank holds the one KV head its query heads use. Norms of a head's dimension
(`attn_q_norm`, `attn_k_norm`) and post-norms are replicated like the others.

Heads are contiguous blocks of `head_dim` rows, so llama.cpp's per-head Q/K permutation
(rows within a head) is unaffected by the split. A row-parallel layer's bias (Llama has
none) is kept by rank 0 only, so the all-reduced sum adds it once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.errors import ConfigError

_COLUMN_HEADS = ("attn_q",)
_COLUMN_KV_HEADS = ("attn_k", "attn_v")
_COLUMN_FFN = ("ffn_gate", "ffn_up")
_ROW_HEADS = ("attn_output",)
_ROW_FFN = ("ffn_down",)


def check_tp(config: LlamaConfig, tp: int) -> None:
    """Raise ConfigError unless `tp` splits heads and the FFN evenly, and either splits the KV
    heads evenly or is a multiple of them (each rank then holds a copy of one KV head)."""
    if tp < 1:
        raise ConfigError(f"tp = {tp} must be at least 1")
    kv = config.n_kv_heads
    if config.n_heads % tp or (kv % tp and tp % kv):
        raise ConfigError(
            f"tp = {tp} does not divide {config.n_heads} attention heads / "
            f"{kv} KV heads (and is not a multiple of the {kv} KV heads)"
        )
    if config.ffn_dim % tp:
        raise ConfigError(f"tp = {tp} does not divide the FFN width {config.ffn_dim}")


def _split(name: str) -> tuple[str, str]:
    """`blk.3.attn_q.weight` -> ("attn_q", "weight"); other names -> ("", "")."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        return parts[2], parts[3]
    return "", ""


def shard_fn(
    config: LlamaConfig, rank: int, tp: int
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """The loader's `shard` callback for `rank` of `tp`: (GGUF name, full tensor) -> shard.

    Returns contiguous tensors; replicated tensors are returned as given.
    """
    check_tp(config, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} out of range for tp = {tp}")
    hd = config.head_dim
    q_rows = config.n_heads // tp * hd
    local_kv = config.shard(tp).n_kv_heads
    kv_rows = local_kv * hd
    # KV heads replicated (tp a multiple of them): rank r's query heads all use KV head
    # r // (tp / KV), so that is the one it holds.
    kv_index = rank // (tp // config.n_kv_heads) if config.n_kv_heads < tp else rank
    ffn_rows = config.ffn_dim // tp

    def column(t: torch.Tensor, size: int, index: int = rank) -> torch.Tensor:
        return t.narrow(0, index * size, size).contiguous()

    def row(t: torch.Tensor, size: int, kind: str) -> torch.Tensor:
        if kind == "bias":  # added once, after the all-reduce sums the ranks
            return t.clone() if rank == 0 else torch.zeros_like(t)
        return t.narrow(t.dim() - 1, rank * size, size).contiguous()

    def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tp == 1:
            return tensor
        layer, kind = _split(name)
        if layer in _COLUMN_HEADS:
            return column(tensor, q_rows)
        if layer in _COLUMN_KV_HEADS:
            return column(tensor, kv_rows, kv_index)
        if layer in _COLUMN_FFN:
            return column(tensor, ffn_rows)
        if layer in _ROW_HEADS:
            return row(tensor, q_rows, kind)
        if layer in _ROW_FFN:
            return row(tensor, ffn_rows, kind)
        return tensor  # norms, token_embd, output, output_norm: replicated

    return shard


def rank_shapes(config: LlamaConfig, tp: int) -> list[dict[str, int]]:
    """Per rank: the attention heads and KV heads it holds (for /v1/node `ranks`)."""
    check_tp(config, tp)
    local = config.shard(tp)
    return [{"heads": local.n_heads, "kv_heads": local.n_kv_heads} for _ in range(tp)]
