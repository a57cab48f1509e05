"""A layer's attention over the paged KV pool, once its Q is rotated and its K/V written:
decode rows in the native kernel where it takes the operands (reading K/V in place through
their token rows), else torch's SDPA; soft-capped scores (gemma2) by hand, which SDPA cannot.

Plain functions of the layer's parameters, called once per layer and step by `Block.steps`
(engine/model/transformer.py): no module state. Shapes as there: B rows, T new tokens per row,
H query heads, KV key/value heads, D head_dim, L attended positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from neuron_trio.engine.model.placement import Placement


def attend_decode(
    kernel: Any,  # the native kernel module, or None (SDPA)
    q: torch.Tensor,  # [B, KV, H/KV, D]
    cache: torch.Tensor,  # the layer's K/V pool: [2KV, pool tokens, D]
    at: Placement,
    act: torch.dtype,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
    start: int = 0,  # the first position attended (a sliding layer's at.window_start)
) -> torch.Tensor:
    """Decode attention, `[B, H · D]`: in the native kernel where it fits, else SDPA.
    `mask` covers positions `start` .. L - 1."""
    kv = q.shape[1]
    if kernel is not None and at.token_rows is not None and cache.dtype == act:
        # Rows on scattered blocks: the kernel reads K/V in place through their token
        # rows (gathering them first cost more than the attention itself at B = 8).
        pool = cache.unsqueeze(0)  # [1, 2KV, pool tokens, D]
        keys, values = pool[:, :kv], pool[:, kv:]
        if native_attention_fits(q, keys, values, mask, softcap):
            rows = at.token_rows[:, start:].contiguous()
            return native_attention(kernel, q, keys, values, mask, scale, rows=rows)
    keys, values = read_kv(cache, at, act, start)
    if kernel is not None and native_attention_fits(q, keys, values, mask, softcap):
        return native_attention(kernel, q, keys, values, mask, scale)
    return attend(q, keys, values, mask, False, scale, softcap).reshape(q.shape[0], -1)


def read_kv(
    cache: torch.Tensor, at: Placement, act: torch.dtype, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' keys and values from position `start` on, each `[B, KV, L - start, D]` in
    `act`: a view of one row on consecutive blocks, else one gather of those positions only
    (padding positions read the zeroed null block)."""
    kv, d = cache.shape[0] // 2, cache.shape[2]
    if isinstance(at.read, slice):
        kv_rows = cache[:, at.read][:, start:].unsqueeze(0)  # [1, 2KV, L - start, D]
    else:
        index = at.read.view(at.b, 2 * kv, at.length)[..., start:].reshape(-1)
        kv_rows = cache.view(-1, d).index_select(0, index).view(at.b, 2 * kv, -1, d)
    if kv_rows.dtype != act:  # a KV cache kept in another dtype than the activations
        kv_rows = kv_rows.to(act)
    return kv_rows[:, :kv], kv_rows[:, kv:]


def attend(
    q: torch.Tensor,  # [B, H, T, D], or decode's [B, KV, H/KV, D]
    keys: torch.Tensor,  # [B, KV, L, D] (or [B, H, L, D] when expanded)
    values: torch.Tensor,
    mask: torch.Tensor | None,  # bool (True = attend) or additive, broadcast to the scores
    causal: bool,
    scale: float | None,  # None: SDPA's 1 / sqrt(D)
    softcap: float | None,
) -> torch.Tensor:
    if not softcap:
        gqa = q.shape[1] != keys.shape[1]
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    # Soft-capped scores (gemma2): cap · tanh(s / cap) before the mask; SDPA cannot.
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [.., T, L]
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        t, length = scores.shape[-2:]
        mask = torch.ones(t, length, dtype=torch.bool, device=q.device).tril(length - t)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    probs = scores.float().softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


def native_attention_fits(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    softcap: float | None,
) -> bool:
    """Whether the native decode attention takes these operands (else SDPA): no soft cap, one
    dtype (bfloat16 or float32) with D contiguous, and no mask or an additive per-row one."""
    dtype = q.dtype
    if softcap or dtype not in (torch.bfloat16, torch.float32):
        return False
    if keys.dtype != dtype or values.dtype != dtype or q.shape[-1] % 8 or q.shape[2] > 16:
        return False
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        return False
    if mask is None:
        return True
    return (
        mask.dtype in (torch.bfloat16, torch.float32)
        and mask.dim() == 4
        and mask.shape[1] == mask.shape[2] == 1
        and mask.stride(-1) == 1
    )


def native_attention(
    kernel: Any,
    q: torch.Tensor,  # [B, KV, G, D]: one query token per row, G query heads per KV head
    keys: torch.Tensor,  # [B, KV, L, D]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # additive [B or 1, 1, 1, L]
    scale: float | None,
    *,
    rows: torch.Tensor | None = None,  # int64 [B, L]: K/V position l of row b is token row
    # rows[b, l] of keys / values, then [1, KV, pool tokens, D] (the paged pool, in place)
) -> torch.Tensor:
    """Decode attention in the native kernel (float32 maths): `[B, KV · G · D]`."""
    b, kv, groups, d = q.shape
    length = keys.shape[2] if rows is None else rows.shape[1]
    out = torch.empty(b, kv * groups * d, dtype=q.dtype)
    flags = int(q.dtype == torch.bfloat16)
    mask_ptr = mask_stride = 0
    if mask is not None:
        mask_ptr = mask.data_ptr()
        mask_stride = mask.stride(0) if mask.shape[0] > 1 else 0
        flags |= 2 * int(mask.dtype == torch.bfloat16)
    qs, ks, vs = q.stride(), keys.stride(), values.stride()
    kernel.attend(
        q.data_ptr(), qs[0], qs[1], qs[2],
        keys.data_ptr(), ks[0], ks[1], ks[2],
        values.data_ptr(), vs[0], vs[1], vs[2],
        mask_ptr, mask_stride, flags, b, kv, groups, length, d, out.data_ptr(),
        scale or 1.0 / math.sqrt(d), 0 if rows is None else rows.data_ptr(),
    )  # fmt: skip
    return out
