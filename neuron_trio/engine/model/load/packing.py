"""Weight-only int4/int8 packing for `dtype = "auto"`: the operands of the CPU kernels.

Packing (`pack_int4`, `pack_int8`) turns a float32 weight `[out, in]` into the operands of
torch's CPU weight-only kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`), which
take bfloat16 activations. int4 is asymmetric per group of 32 inputs (min/max), which
reproduces Q4_0/Q4_1 blocks up to rounding of their scales; int8 is symmetric per output row.
`pack_q4`/`tile_q4` and `pack_q8`/`tile_q8` lay weights out for the native kernel
(`_cpu_kernel.c`), which `native_kernel()` finds.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Concatenate, ParamSpec, TypeVar, cast

import numpy as np
import torch

# ---- weight-only packing for torch's CPU kernels ----------------------------------------

INT4_GROUP = 32
# A large weight is packed this many rows at a time: the float32 temporaries of a slice stay
# in the caches (Qwen2.5 0.5B's 151,936 x 896 head, pack_q4_symmetric on 2 cores: 2.9 s
# whole, 0.8-1.0 s by 1,024 rows; 256 and 4,096 rows were slower).
_CHUNK_ROWS = 1024
_Packed = TypeVar("_Packed", bound=tuple[torch.Tensor, ...])
_P = ParamSpec("_P")


def pack_rows(n_rows: int, pack_slice: Callable[[int, int], _Packed]) -> _Packed:
    """The join of `pack_slice(start, stop)` over a weight's `n_rows` rows, _CHUNK_ROWS at a
    time: a per-row packing of slices it makes itself (e.g. dequantised from a file's blocks),
    so the whole float32 weight is never in memory."""
    parts = [pack_slice(r, min(r + _CHUNK_ROWS, n_rows)) for r in range(0, n_rows, _CHUNK_ROWS)]
    return cast(_Packed, tuple(torch.cat(column) for column in zip(*parts, strict=True)))


def _by_row_slices(
    pack: Callable[Concatenate[torch.Tensor, _P], _Packed],
) -> Callable[Concatenate[torch.Tensor, _P], _Packed]:
    """`pack` over slices of _CHUNK_ROWS rows of a larger weight, joined: the same values, as
    each output row of `pack` depends on its own input row only (per-row or per-group
    scales)."""

    @functools.wraps(pack)
    def by_slices(weight: torch.Tensor, /, *args: _P.args, **kwargs: _P.kwargs) -> _Packed:
        if weight.shape[0] <= _CHUNK_ROWS:
            return pack(weight, *args, **kwargs)
        return pack_rows(weight.shape[0], lambda a, b: pack(weight[a:b], *args, **kwargs))

    return by_slices


def pack_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[out, in]` → (packed weight, scales_and_zeros `[in/group, out, 2]` bfloat16).

    Asymmetric per group: w ≈ (q - 8) · scale + zero with q in 0..15, the layout of
    `torch.ops.aten._weight_int4pack_mm_for_cpu`. `in` must be a multiple of `group`.
    """
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group, group)
    lo = w.amin(dim=-1, keepdim=True)
    hi = w.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)  # [out, groups, 1]
    q = torch.round((w - lo) / scale).clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
    zero = lo + 8.0 * scale
    scales_zeros = torch.stack((scale.squeeze(-1), zero.squeeze(-1)), dim=-1)  # [out, groups, 2]
    scales_zeros = scales_zeros.transpose(0, 1).contiguous().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, scales_zeros


@_by_row_slices
def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[out, in]` → (int8 `[out, in]`, bfloat16 scales `[out]`), symmetric per row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)


@_by_row_slices
def pack_q4(
    weight: torch.Tensor, group: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 `[out, in]` → (nibbles uint8 `[out, in/2]`, scale, minimum float16
    `[out, in/group]`) for the native kernel (`_cpu_kernel.c`): w ≈ scale · q + minimum, q in
    0..15 (min/max per group, rounded to float16 as Q4_1 stores them, so Q4_1 blocks come
    back exactly). In each group's 16 bytes, the low nibbles hold elements 0..15 and the high
    nibbles 16..31 (ggml's order).
    """
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group, group)
    lo = w.amin(dim=-1, keepdim=True).half().float()
    hi = w.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15.0).half().float()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((w - lo) * inv).clamp(0, 15).to(torch.uint8)  # [out, groups, group]
    scale16, lo16 = scale.reshape(out_f, -1).half(), lo.reshape(out_f, -1).half()
    return _nibbles(q), scale16, lo16


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 `[out, groups, group]` (0..15) → `[out, in/2]` bytes: in each group's
    bytes, the low nibbles hold elements 0 .. group/2 - 1 and the high ones the rest."""
    out_f, groups, group = q.shape
    half = group // 2
    return (q[..., :half] | (q[..., half:] << 4)).reshape(out_f, groups * half).contiguous()


@_by_row_slices
def pack_q4_symmetric(
    weight: torch.Tensor, group: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[out, in]` → (nibbles uint8 `[out, in/2]` as pack_q4 lays them, scale float16
    `[out, in/group]`): w ≈ scale · (q - 8), q in 0..15, as Q4_0 (the group's value of largest
    magnitude is -8 steps). The native kernel's coarse kind (Q4Linear's `coarse`): no minimum
    to read or add."""
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group, group)
    extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))  # signed
    scale = (extreme / -8.0).half().float()
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    q = (torch.round(w * inv) + 8).clamp(0, 15).to(torch.uint8)  # [out, groups, group]
    return _nibbles(q), scale.reshape(out_f, -1).half()


def pack_q5(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """5-bit codes uint8 `[out, in]` (0..31, e.g. quant.five_bit_codes) → (nibbles `[out,
    in/2]` as pack_q4 lays them, the fifth bits `[out, in]` as 0/1) for the native kernel."""
    out_f, in_f = q.shape
    grouped = q.reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)
    return _nibbles(grouped & 0x0F), (q >> 4) & 1


Q4_TILE = 8  # output rows the native kernel computes together


def tile_q4(
    nibbles: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_q4`'s output → the native kernel's layout, tiles of Q4_TILE rows (`out` must be a
    multiple): per tile and group, 4 steps x 8 rows x 4 bytes of nibbles (step k's weights in
    the low nibbles, step k + 4's in the high ones), then 8 scales and 8 minimums."""
    out_f, groups = scale.shape
    tiles, rows = out_f // Q4_TILE, Q4_TILE
    tiled = nibbles.reshape(tiles, rows, groups, 4, 4).permute(0, 2, 3, 1, 4)

    def per_group(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(tiles, rows, groups).transpose(1, 2).contiguous()

    return tiled.contiguous(), per_group(scale), per_group(minimum)


def tile_high(high: torch.Tensor) -> torch.Tensor:
    """pack_q5's fifth bits `[out, in]` (0/1) → the native kernel's layout: per tile of Q4_TILE
    rows and group of 32, 8 steps of 32 bits (little-endian), bit 4 r + i of step s holding row
    r's weight 4 s + i of the group (the lane and byte of that weight in the step's vector)."""
    out_f, in_f = high.shape
    tiles, groups = out_f // Q4_TILE, in_f // INT4_GROUP
    bits = high.reshape(tiles, Q4_TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)
    bits = bits.reshape(tiles, groups, 8, 32).to(torch.uint8)  # [.., step, bit of the 32]
    # numpy's packbits: ~1.7x torch's weighted sum (a 0.5B model's first start: ~0.3 s)
    return torch.from_numpy(np.packbits(bits.numpy(), axis=-1, bitorder="little"))


@_by_row_slices
def pack_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[out, in]` → (int8 `[out, in]`, float32 scales `[out]`), symmetric per row
    (pack_int8's grid, with its scales kept in float32) for the native kernel."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def tile_q8(weight: torch.Tensor) -> torch.Tensor:
    """pack_q8's int8 `[out, in]` → the native kernel's tiles: per tile of Q4_TILE rows and
    group of 32, 8 steps x 8 rows x 4 bytes."""
    out_f, in_f = weight.shape
    tiles, groups = out_f // Q4_TILE, in_f // INT4_GROUP
    tiled = weight.reshape(tiles, Q4_TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)
    return tiled.contiguous()


def tile_group_scales(scale: torch.Tensor) -> torch.Tensor:
    """A scale per row and group of 32 `[out, in/32]` (quant.int8_codes' float16) → the tiles'
    layout `[tiles, groups, Q4_TILE]`, as tile_q4 lays out the 4-bit weights' scales."""
    out_f, groups = scale.shape
    return scale.reshape(out_f // Q4_TILE, Q4_TILE, groups).transpose(1, 2).contiguous()


def q8_group_sums(weight: torch.Tensor) -> torch.Tensor:
    """pack_q8's int8 `[out, in]` → 128 x each row's sum over each group of 32, int32 in the
    tiles' layout `[tiles, groups, Q4_TILE]`: the AVX-512 kernel feeds it x + 128 (an unsigned
    operand) and takes this back out."""
    out_f, in_f = weight.shape
    sums = weight.reshape(out_f, in_f // INT4_GROUP, INT4_GROUP).sum(-1, dtype=torch.int32) * 128
    return sums.reshape(out_f // Q4_TILE, Q4_TILE, -1).transpose(1, 2).contiguous()


def native_kernel() -> ModuleType | None:
    """The native 4-bit kernel (`_cpu_kernel.c`, built at install), or None where it was not
    built or this CPU has neither AVX2 nor AVX-512 VNNI; then "auto" uses torch's int4 kernel.
    `NEURON_NATIVE_KERNEL=0` turns it off (to compare, or to rule it out).
    """
    if os.environ.get("NEURON_NATIVE_KERNEL", "1") == "0":
        return None
    try:
        from neuron_trio.engine.model import _cpu_kernel  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _cpu_kernel if _cpu_kernel.isa() else None


def native_dense_copies() -> bool:
    """Whether the native kernel's layers keep a bfloat16 copy of their weight for prefill
    chunks of NATIVE_DENSE_MIN_ROWS rows or more (a dense GEMM in torch), which doubles the
    weights' memory and more: only with `NEURON_DENSE_COPIES=1`. Memory first (issue 49: RSS
    after load at most llama.cpp's): on an Intel Xeon with AMX the copies held Gemma 3 270M at
    1,092 MiB and Qwen2.5 0.5B at 1,657 (893 and 954 without; llama.cpp 917 and 969:
    bench/bench_footprint.py), for a dense GEMM that ran 512-row chunks ~2.7-4.6x faster than
    the kernel there (1,493 vs 551 tok/s, a 0.5B model; a 9,728 x 896 layer 53 vs 205 ms);
    without AMX they gained 5-25% (an AMD EPYC: Qwen2.5 0.5B, 512 tokens, 427 vs 390 tok/s).
    The kernel's prefill without them was 1.4-2.1x llama.cpp's (README's table, that EPYC).
    """
    return os.environ.get("NEURON_DENSE_COPIES") == "1"


def int4_available() -> bool:
    """Whether this torch build has the CPU int4 weight-only kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )
