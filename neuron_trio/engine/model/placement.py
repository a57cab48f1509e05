"""Where one forward's rows write and read a layer's paged KV pool, worked out once per forward
from the rows' block tables and lengths (`Transformer.forward_steps`), then read by every layer
(RoPE's K/V write, attention's K/V read and masks).

Indices address a layer's K/V `[2KV, pool tokens, D]` flattened to `[2KV · pool, D]`; one row on
consecutive blocks gets slices instead (views, no gather). Shapes: B rows, T new tokens per
row, R real tokens, L attended positions.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from neuron_trio.engine.block_pool import BLOCK_TOKENS, NULL_BLOCK, blocks_for

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


def place_rows(
    start_pos: torch.Tensor,
    lens: list[int],
    t: int,
    tables: torch.Tensor,
    *,
    pool_tokens: int,
    n_kv_heads: int,
    act: torch.dtype,
    dev: torch.device,
) -> tuple[Placement, torch.Tensor]:
    """One forward's placement, and its query positions (B · T, or R: see `place_packed`):
    B rows continuing from `start_pos` (host) with `lens` real tokens each, padded to `t`, on
    the block tables `[B, W]` (host). ValueError if the tables do not reach the last
    position. Masks: none for one prompt from position 0 (causal), bool for chunks, additive
    (in `act`) for decode rows of different lengths."""
    starts = start_pos.tolist()
    ends = [s + n for s, n in zip(starts, lens, strict=True)]
    at = Placement()
    at.b, at.t, at.length = len(lens), t, max(ends)
    n_blocks = blocks_for(at.length)
    if tables.shape[1] < n_blocks:
        raise ValueError(
            f"position {at.length - 1} needs {n_blocks} KV blocks; the tables have "
            f"{tables.shape[1]}"
        )
    place_blocks(at, tables[:, :n_blocks], starts, ends, pool_tokens, n_kv_heads, dev)
    if t > 1 and (at.b > 1 or lens[0] != t):  # prompt chunks packed into one batch
        return at, place_packed(at, start_pos, lens, dev)
    if at.b == 1:  # one prompt chunk, or one decode row
        positions = start_pos.to(dev) + torch.arange(t, device=dev)  # [T]
        if t > 1 and starts[0] == 0:
            at.causal = True
        elif t > 1:  # a chunk after a cached prefix: query i sees keys 0 .. start + i
            cols = torch.arange(at.length, device=dev)
            at.mask = (cols[None, :] <= positions[:, None])[None, None]  # [1, 1, T, L]
        return at, positions
    if min(ends) != at.length:  # decode rows of different lengths
        at.row_ends = torch.tensor(ends, dtype=torch.int64)
        at.mask = _additive(
            torch.arange(at.length, device=dev)[None, :] < at.row_ends.to(dev)[:, None], act
        )[:, None, None]  # [B, 1, 1, L]
    return at, start_pos.to(dev)  # [B]


def _additive(attend: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as an additive one (0 / -inf in `dtype`): the same scores, without SDPA
    converting a bool mask in every layer (~4 us a layer at B = 8)."""
    mask = torch.zeros(attend.shape, dtype=dtype, device=attend.device)
    return mask.masked_fill_(~attend, float("-inf"))


def place_window(
    at: Placement,
    positions: torch.Tensor,
    first_start: int,
    window: int,
    additive: torch.dtype | None,
) -> None:
    """Sliding layers' keys (`window`), once the attended positions exceed it: no query sees
    a key before the earliest query's (`first_start`'s) window, so they attend from there on
    (rounded down to WINDOW_ALIGN: the native attention's lanes then add the same terms in the
    same order, the same bits as from position 0); each query sees keys pos - W < k <= pos.
    `additive`: decode rows for the native attention, the mask as 0 / -inf in that dtype."""
    first = max(0, first_start - window + 1)
    at.window_start = first - first % WINDOW_ALIGN
    qpos = positions.view(at.b, -1)  # [B, T] query positions
    cols = torch.arange(at.window_start, at.length, device=positions.device)
    inside = (cols <= qpos[..., None]) & (cols > qpos[..., None] - window)
    at.window_mask = inside[:, None]  # [B, 1, T, L - window_start]
    if additive is not None:
        at.window_mask = _additive(at.window_mask, additive)


def output_rows(at: Placement, x: torch.Tensor, lens: list[int], all_logits: bool) -> torch.Tensor:
    """The layers' output `x` (`[B · T, dim]`, or `[R, dim]` for padded chunks) as the rows
    whose logits are wanted: each row's last real token `[B, dim]`, or with `all_logits`
    every position `[B, T, dim]` (padding: zeros)."""
    b, t, dim, dev = at.b, at.t, x.shape[-1], x.device
    if at.real is None:
        x = x.view(b, t, dim)
        if all_logits:
            return x
        if all(n == t for n in lens):
            return x[:, -1]
        return x[torch.arange(b, device=dev), torch.tensor(lens, device=dev) - 1]
    if all_logits:  # back to [B, T]
        return x.new_zeros(b * t, dim).index_copy_(0, at.real, x).view(b, t, dim)
    # each row's last real token: the real rows are in order, row after row
    return x[torch.tensor(list(itertools.accumulate(lens)), device=dev) - 1]
