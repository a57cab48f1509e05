"""Where one forward's rows write and read a layer's paged KV pool, worked out once per forward
from the rows' block tables and lengths (`Transformer.forward_steps`), then read by every layer
(RoPE's K/V write, attention's K/V read and masks).

Indices address a layer's K/V `[2KV, pool tokens, D]` flattened to `[2KV · pool, D]`; one row on
consecutive blocks gets slices instead (views, no gather). Shapes: B rows, T new tokens per
row, R real tokens, L attended positions.
"""

from __future__ import annotations

import numpy as np
import torch

from neuron_trio.engine.block_pool import BLOCK_TOKENS, NULL_BLOCK

# Where sliding layers start attending is rounded down to a multiple of this: the native
# attention's vector lanes then see the same keys as from position 0 (the skipped ones only
# ever added exact zeros), so its bits do not depend on where the window starts.
WINDOW_ALIGN = 64


class Placement:
    """Where one forward's rows write and read the KV pool; computed once, used by every layer."""

    __slots__ = (
        "b", "causal", "length", "mask", "positions", "read", "real", "row_ends", "t",
        "token_rows", "window_mask", "window_start", "write", "write_rows",
    )  # fmt: skip

    def __init__(self) -> None:
        self.b = 1  # rows
        self.t = 1  # tokens per row (padded rows: the longest row's)
        # Where the real tokens' K/V go: a slice of token rows (one row on consecutive
        # blocks) or an index [2KV · R] into the layer's [2KV · pool, D] rows.
        self.write: slice | torch.Tensor = slice(0, 0)
        # The real tokens' token rows in the pool, int64 [R] on the host (the native RoPE's).
        self.write_rows: torch.Tensor | None = None
        # With the native RoPE (Transformer.native_kernel): the R rows' positions, int64 on
        # the host; the layers then get the float32 RoPE tables instead of per-row ones.
        self.positions: torch.Tensor | None = None
        # Padded prompt chunks: the indices of the real tokens among the B · T rows. Only
        # those R rows go through the layers (the residual stream is [R, dim]); attention
        # alone lays them out as [B, T].
        self.real: torch.Tensor | None = None
        # Where the rows' K/V are read: a slice of L token rows (one row on consecutive
        # blocks) or an index [B · 2KV · L] into the layer's [2KV · pool, D] rows.
        self.read: slice | torch.Tensor = slice(0, 0)
        # With `read` an index on the CPU: the token row of each row's positions, int64 [B, L]
        # (the native decode attention reads K/V through it, in place).
        self.token_rows: torch.Tensor | None = None
        self.length = 0  # L: positions attended (the longest row's end)
        self.mask: torch.Tensor | None = None  # bool (True = attend) or additive (0 / -inf)
        # Decode rows of different lengths: each row's end, int64 [B] on the host (the native
        # decode attention reads no key past it; `mask` still masks them for everyone else).
        self.row_ends: torch.Tensor | None = None
        self.causal = False
        # Sliding layers: bool [B, 1, T, L - window_start] over positions window_start ..
        # L - 1, True where a key lies within the window of the query (and is attended at
        # all); None when no query's window excludes a key. Decode rows with the native
        # kernel: additive [B, 1, 1, L - window_start] (0 / -inf), as `mask`.
        self.window_mask: torch.Tensor | None = None
        # Sliding layers: keys before this position lie outside every query's window, and the
        # layers attend from here on (a multiple of WINDOW_ALIGN). Gemma 3 270M (15 of its 18
        # layers slide, window 512): a 2,048-token prefill ~0.35 s sooner of ~2.9 s; a decode
        # step at 3,900 tokens of context 15.1 -> 8.6 ms, at 2,048 10.7 -> 7.9 ms.
        self.window_start = 0


def place_blocks(
    at: Placement,
    tables: torch.Tensor,
    starts: list[int],
    ends: list[int],
    pool_tokens: int,
    n_kv_heads: int,
    dev: torch.device,
) -> None:
    """Fill `at.write` and `at.read` from the rows' block tables `[B, blocks_for(L)]`
    (host): slices of the pool's token rows, or indices into each layer's K/V flattened
    to `[2KV · pool_tokens, D]` (an index_select there is ~6x faster than indexing the
    token dimension, and gathers straight into the `[B, 2KV, L, D]` attention reads)."""
    length = at.length
    first = int(tables[0, 0])
    if at.b == 1 and tables[0].tolist() == list(range(first, first + tables.shape[1])):
        base = first * BLOCK_TOKENS  # consecutive blocks: one slice of the pool
        at.write = slice(base + starts[0], base + ends[0])
        at.write_rows = torch.arange(base + starts[0], base + ends[0])
        at.read = slice(base, base + length)
        return
    # In numpy: a dozen small ops on [B, L] integers, each ~1 us there and ~8 us in torch
    # (~0.2 ms of a step at 8 rows).
    cols = np.arange(length)
    offsets = cols % BLOCK_TOKENS
    blocks = tables.numpy().astype(np.int64, copy=False)
    rows = np.repeat(blocks, BLOCK_TOKENS, axis=1)[:, :length] * BLOCK_TOKENS + offsets
    # Positions past a row's end (another row is longer) read the zeroed null block, never
    # stale or uninitialised memory: masked garbage could be NaN, and NaN - inf is NaN.
    beyond = cols[None, :] >= np.asarray(ends)[:, None]
    rows = np.where(beyond, NULL_BLOCK * BLOCK_TOKENS + offsets, rows)  # [B, L]
    heads = np.arange(2 * n_kv_heads) * pool_tokens  # [2KV]
    at.read = torch.from_numpy((heads[None, :, None] + rows[:, None, :]).reshape(-1)).to(dev)
    if dev.type == "cpu":
        at.token_rows = torch.from_numpy(np.ascontiguousarray(rows))
    spans = zip(starts, ends, strict=True)
    written = np.concatenate([rows[i, s:e] for i, (s, e) in enumerate(spans)])  # [R]
    at.write_rows = torch.from_numpy(written)
    at.write = torch.from_numpy((heads[:, None] + written[None, :]).reshape(-1)).to(dev)


def place_packed(
    at: Placement, start_pos: torch.Tensor, lens: list[int], dev: torch.device
) -> torch.Tensor:
    """Fill `at` for B prompt chunks padded to T tokens; return the N = B · T positions.

    Row b's real tokens go to positions start_b .. start_b + len_b - 1. A padding token
    takes its row's last real position (so it stays inside the RoPE tables and attends to
    its own row only); it is not written to the cache, so it can never be attended by
    anyone, and its output is dropped.
    """
    b, t = at.b, at.t
    lens_t = torch.tensor(lens, device=dev)[:, None]  # [B, 1]
    offsets = torch.arange(t, device=dev)[None, :]  # [1, T]
    pos = start_pos.to(dev)[:, None] + torch.minimum(offsets, lens_t - 1)  # [B, T]
    if sum(lens) != b * t:
        real = offsets < lens_t  # [B, T]
        at.real = real.reshape(-1).nonzero().squeeze(1)  # [R] indices into N
    # Query (b, i) sees its own row's keys up to its own position: the cached prefix,
    # then its chunk causally. Keys past a row's end (another row's length) never.
    cols = torch.arange(at.length, device=dev)
    at.mask = (cols <= pos[:, :, None])[:, None]  # [B, 1, T, L]
    return pos.reshape(-1)
