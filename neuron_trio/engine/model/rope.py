"""Rotary position embeddings: the tables (cos and signed sin per position, built once per
context by `Transformer.init_rope`), each row's slice of them for torch's RoPE, and the native
kernel's RoPE with the K/V write in one call.

The sign of rotate-half rides in sin, (-sin, +sin), so that RoPE(x) = x·cos + roll(x, D/2)·sin
on every head at once (the V heads get cos = 1, sin = 0). Shapes: N rows, H query heads, KV
key/value heads, D head_dim, P positions.
"""

from __future__ import annotations

from typing import Any

import torch

from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.engine.model.placement import Placement


def rope_table(inv: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 cos and signed sin `[P, D]` for the inverse frequencies `inv` [D / 2]."""
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]  # [P, D/2]
    cos, sin = ang.cos(), ang.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rope_rows(
    c: LlamaConfig, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for rows at `positions` [N], over all heads: [N, H + 2KV, D].

    Q and K heads rotate; the V heads (the last KV) get cos = 1, sin = 0.
    """
    n, qk_heads = positions.shape[0], c.n_heads + c.n_kv_heads
    cos = cos_table[positions][:, None].expand(n, qk_heads, c.head_dim)
    sin = sin_table[positions][:, None].expand(n, qk_heads, c.head_dim)
    ones = cos.new_ones(n, c.n_kv_heads, c.head_dim)
    zeros = sin.new_zeros(n, c.n_kv_heads, c.head_dim)
    return torch.cat((cos, ones), dim=1), torch.cat((sin, zeros), dim=1)


def rope_write(
    kernel: Any,  # the native kernel module
    qkv: torch.Tensor,  # [N, H + 2KV, D]
    tables: tuple[torch.Tensor, torch.Tensor],  # float32 cos, signed sin: [P, D]
    cache: torch.Tensor,  # the layer's K/V pool: [2KV, pool tokens, D]
    at: Placement,
    act: torch.dtype,
    h: int,
    kv: int,
    qk_norm: torch.Tensor | None = None,  # float32 [H + KV, D]
    eps: float = 0.0,
) -> torch.Tensor:
    """RoPE on the Q and K heads, K and V into the cache at `at.write_rows`, in the
    native kernel (float32 maths, rounded once); returns Q `[N, H, D]` in `act`. With
    `qk_norm`, each Q and K head is RMS-normed (times its weight) first."""
    qkv = qkv.contiguous()
    n, d = qkv.shape[0], qkv.shape[2]
    q = torch.empty(n, h, d, dtype=act)
    cos, sin = tables
    positions, rows = at.positions, at.write_rows
    assert positions is not None and rows is not None
    bf16 = torch.bfloat16
    flags = int(qkv.dtype == bf16) | 2 * int(cache.dtype == bf16) | 4 * int(act == bf16)
    kernel.rope_write(
        qkv.data_ptr(), n, h, kv, d, flags, positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), cache.data_ptr(), cache.shape[1], rows.data_ptr(),
        q.data_ptr(), 0 if qk_norm is None else qk_norm.data_ptr(), eps,
    )  # fmt: skip
    return q
