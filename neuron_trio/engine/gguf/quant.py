"""GGML block formats → torch (the weights' packing for the kernels: engine/model/load/packing.py).

Dequantisation works on the raw bytes of a tensor (a uint8 view of the memory-mapped file,
`[n_blocks, type_size]`) with vectorised torch ops: the whole tensor at once, no Python loop
per block. Formats follow ggml's `ggml-quants.c`; tests check each one against the `gguf`
package's reference (numpy) implementation on random blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum

import numpy as np
import torch


class QType(IntEnum):
    """ggml tensor types (the numbering of `gguf.GGMLQuantizationType`)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ4_NL = 20
    IQ4_XS = 23
    BF16 = 30


QK_K = 256

# (elements per block, bytes per block) of every type this module can dequantise.
BLOCK_SIZES: dict[QType, tuple[int, int]] = {
    QType.F32: (1, 4),
    QType.F16: (1, 2),
    QType.BF16: (1, 2),
    QType.Q8_0: (32, 2 + 32),
    QType.Q4_0: (32, 2 + 16),
    QType.Q4_1: (32, 2 + 2 + 16),
    QType.Q5_0: (32, 2 + 4 + 16),
    QType.Q5_1: (32, 2 + 2 + 4 + 16),
    QType.IQ4_NL: (32, 2 + 16),
    QType.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    QType.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    QType.IQ4_XS: (QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
    QType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    QType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    QType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}

SUPPORTED = frozenset(BLOCK_SIZES)


def qtype_name(raw: int) -> str:
    """A readable name for a ggml type number (also for types we do not support)."""
    try:
        return QType(raw).name
    except ValueError:
        try:
            import gguf  # only for the name of an exotic type in an error message

            return gguf.GGMLQuantizationType(raw).name
        except (ImportError, ValueError):
            return f"type {raw}"


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 `[n_blocks, 1]`."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[n, k]` bytes → `[n, 2k]`: all low nibbles, then all high nibbles (ggml's order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return d * q


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).float()  # [n, 32]
    return d * (q - 8.0)


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:]).float()  # [n, 32]
    return d * q + m


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """`[n, 4]` bytes (a little-endian uint32) → `[n, 32]`: bit j is element j's 5th bit."""
    if qh.device.type == "cpu":  # numpy's unpackbits: ~4x torch's shifts (a first start's 0.4 s)
        bits = np.unpackbits(qh.numpy(), axis=-1, bitorder="little")
        return torch.from_numpy(bits).reshape(-1, 32) << 4
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.reshape(-1, 4, 1) >> shifts) & 1).reshape(-1, 32) << 4


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).float()  # [n, 32]
    return d * (q - 16.0)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])).float()  # [n, 32]
    return d * q + m


# IQ4's 16 non-linear levels (ggml's kvalues_iq4nl)
_IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_levels(q: torch.Tensor) -> torch.Tensor:
    levels = torch.tensor(_IQ4_LEVELS, dtype=torch.float32, device=q.device)
    return levels[q.long()]


def _dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _iq4_levels(_nibbles(blocks[:, 2:]))  # [n, 32]


def _dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    high = blocks[:, 2].to(torch.int32) | (blocks[:, 3].to(torch.int32) << 8)  # [n] uint16
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=blocks.device)
    scales_h = (high[:, None] >> shifts) & 3  # [n, 8]
    scales_l = torch.cat((blocks[:, 4:8, None] & 0x0F, blocks[:, 4:8, None] >> 4), dim=2)
    scales = (scales_l.reshape(n, 8).to(torch.int32) | (scales_h << 4)) - 32  # [n, 8]
    qs = blocks[:, 8:].reshape(n, 8, 1, 16)
    q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32)
    return ((d * scales.float()).unsqueeze(-1) * _iq4_levels(q)).reshape(n, QK_K)


def _dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    q = ((blocks[:, 16:80].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16).float()
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)  # [n, 16, 1]
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q3_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks → `[n, 16, 16]` int32 (sc - 32) · q, per sub-block of 16: the weights
    before the block's d. 16 six-bit scales: low nibbles from bytes 0..7 (low then high
    halves), top 2 bits from 8..11; a clear high bit of q means "minus 4" (ggml stores it
    inverted)."""
    n, dev = blocks.shape[0], blocks.device
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    low = torch.cat((packed[:, :8] & 0x0F, packed[:, :8] >> 4), dim=1)
    two = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=dev)
    top = ((packed[:, 8:12].reshape(n, 1, 4) >> two.reshape(1, 4, 1)) & 3).reshape(n, 16)
    scales = (low | (top << 4)).to(torch.int32) - 32
    ql = ((qs.reshape(n, 2, 1, 32) >> two.reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    bits = torch.arange(8, dtype=torch.uint8, device=dev).reshape(1, 1, 8, 1)
    qh = ((hmask.reshape(n, 1, 1, 32) >> bits) & 1).reshape(n, 16, 16)
    q = ql.to(torch.int32) - ((qh ^ 1).to(torch.int32) << 2)
    return scales.unsqueeze(-1) * q


def _dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # d · ((sc - 32) · q): the same floats as (d · (sc - 32)) · q, both products exact
    d = _f16(blocks, 108).unsqueeze(-1)  # [n, 1, 1]
    return (d * _dequant_q3_k_codes(blocks).float()).reshape(-1, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in 12 bytes (Q4_K, Q5_K): each `[n, 8]`."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mn = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[n, 128]` bytes → `[n, 8, 32]`: per 32-byte chunk, its low then its high nibbles."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32)


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    q = _k_low_nibbles(blocks[:, 16:]).float()  # [n, 8, 32]
    out = (d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)
    return out.reshape(-1, QK_K)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(-1, 1, 32)  # bit j of qh[l] is the 5th bit of sub-block j
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 8, 1)
    high = ((qh >> shifts) & 1) << 4  # [n, 8, 32]
    q = (_k_low_nibbles(blocks[:, 48:]) | high).float()
    out = (d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)
    return out.reshape(-1, QK_K)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 64)  # two halves of 128 outputs
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _f16(blocks, 208)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 3) << 4  # [n, 2, 4, 32]
    q = (low | high).float() - 32.0  # [n, 2, 4, 32]: 16 groups of 16 in output order
    out = (d * scales).reshape(n, 16, 1) * q.reshape(n, 16, 16)
    return out.reshape(n, QK_K)


_DEQUANT: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q8_0: _dequant_q8_0,
    QType.Q4_0: _dequant_q4_0,
    QType.Q4_1: _dequant_q4_1,
    QType.Q5_0: _dequant_q5_0,
    QType.Q5_1: _dequant_q5_1,
    QType.IQ4_NL: _dequant_iq4_nl,
    QType.IQ4_XS: _dequant_iq4_xs,
    QType.Q2_K: _dequant_q2_k,
    QType.Q3_K: _dequant_q3_k,
    QType.Q4_K: _dequant_q4_k,
    QType.Q5_K: _dequant_q5_k,
    QType.Q6_K: _dequant_q6_k,
}


def dequantize(raw: torch.Tensor, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes of one tensor (uint8, any shape, contiguous) → float32 tensor of `shape`.

    `shape` is in torch order (outermost first); its last dimension is a multiple of the
    format's block size. Float formats are converted, never aliased to the input.
    """
    flat = raw.reshape(-1)
    if qtype == QType.F32:
        return flat.view(torch.float32).reshape(shape).clone()
    if qtype == QType.F16:
        return flat.view(torch.float16).float().reshape(shape)
    if qtype == QType.BF16:
        return flat.view(torch.bfloat16).float().reshape(shape)
    return _DEQUANT[qtype](flat.reshape(-1, _block_bytes(qtype, shape))).reshape(shape)


# The formats whose weights are w = scale · q + minimum per group of 32 inputs, with q the
# file's own 4- or 5-bit codes (Q4_K/Q5_K: per sub-block of 32, scale d · sc and minimum
# -dmin · m): the native kernel's 4- and 5-bit layers keep them (`affine_codes`).
FOUR_BIT = frozenset({QType.Q4_0, QType.Q4_1, QType.Q4_K})
FIVE_BIT = frozenset({QType.Q5_0, QType.Q5_1, QType.Q5_K})
AFFINE = FOUR_BIT | FIVE_BIT


def _block_codes(blocks: torch.Tensor, qtype: QType) -> tuple[torch.Tensor, ...]:
    """(q uint8 `[n, block]`, scale, minimum float32 `[n, block / 32]`) of `[n, type_size]`
    blocks of an AFFINE format: w = scale · q + minimum per 32 codes, as `dequantize`."""
    n = blocks.shape[0]
    if qtype in (QType.Q4_K, QType.Q5_K):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scale_min(blocks[:, 4:16])
        if qtype == QType.Q4_K:
            q = _k_low_nibbles(blocks[:, 16:])
        else:
            shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 8, 1)
            q = _k_low_nibbles(blocks[:, 48:]) | (
                ((blocks[:, 16:48, None].transpose(1, 2) >> shifts) & 1) << 4
            )
        return q.reshape(n, QK_K), d * sc, -(dmin * mn)
    d = _f16(blocks, 0)
    if qtype == QType.Q4_0:
        return _nibbles(blocks[:, 2:]), d, d * -8.0
    if qtype == QType.Q4_1:
        return _nibbles(blocks[:, 4:]), d, _f16(blocks, 2)
    if qtype == QType.Q5_0:
        return _nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6]), d, d * -16.0
    return _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8]), d, _f16(blocks, 2)


def affine_codes(
    raw: torch.Tensor, qtype: QType, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An AFFINE tensor's own codes, for a kernel that keeps them (no float round trip):
    (q uint8 `[out, in]`, 0..15 for FOUR_BIT and 0..31 for FIVE_BIT; scale and minimum
    float16 `[out, in / 32]`) with w = scale · q + minimum as `dequantize` computes it. Q4_0
    and Q5_0 (minimum -8 · d, -16 · d) and Q4_1 and Q5_1 come back exactly; a K-quant's
    scale d · sc and minimum -dmin · m are rounded to float16 (at least d's own precision:
    sc and m are integers, 1 or more where they are not zero)."""
    if qtype not in AFFINE:
        raise ValueError(f"{qtype.name} has no 4- or 5-bit affine codes")
    out_f, in_f = shape
    q, scale, minimum = _block_codes(raw.reshape(-1, _block_bytes(qtype, shape)), qtype)
    groups = in_f // 32
    return (
        q.reshape(out_f, in_f),
        scale.reshape(out_f, groups).half(),
        minimum.reshape(out_f, groups).half(),
    )


def five_bit_codes(
    raw: torch.Tensor, qtype: QType, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`affine_codes` of a FIVE_BIT tensor (q in 0..31)."""
    if qtype not in FIVE_BIT:
        raise ValueError(f"{qtype.name} is not a 5-bit format")
    return affine_codes(raw, qtype, shape)


def _block_bytes(qtype: QType, shape: tuple[int, ...]) -> int:
    """The bytes of one of `qtype`'s blocks, once the rows of `shape` are seen to be whole
    blocks (ValueError naming the type otherwise)."""
    block, type_size = BLOCK_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"{qtype.name}: last dimension {shape[-1]} is not a multiple of {block}")
    return type_size


def raw_nbytes(qtype: QType, n_elements: int) -> int:
    """Bytes that `n_elements` values take in format `qtype`."""
    block, type_size = BLOCK_SIZES[qtype]
    return n_elements // block * type_size


# The formats the native kernel's int8 layer with a scale per row and group of 32 keeps
# (`int8_codes`): exactly where the values are integers times a scale per 32 (Q8_0, IQ4_NL,
# IQ4_XS: d · (ls - 32) per 32, rounded to float16; Q3_K: d per 256 and (sc - 32) · q per 16
# as the code, of which only -32 · -4 = 128 does not fit int8 and becomes 127), on an 8-bit
# grid per 32 otherwise (Q2_K's minimums and Q6_K's 6-bit codes times 8-bit scales).
GROUPED8_EXACT = frozenset({QType.Q8_0, QType.IQ4_NL, QType.IQ4_XS, QType.Q3_K})
GROUPED8 = GROUPED8_EXACT | {QType.Q2_K, QType.Q6_K}


def grid8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[..., in]` → (int8 codes, float16 scales `[..., in / 32]`): symmetric per 32,
    the scale the group's largest magnitude / 127 (rounded to float16, then the codes to it)."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    scale = (g.abs().amax(dim=-1, keepdim=True) / 127.0).half().float()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(g * inv).clamp(-127, 127).to(torch.int8).reshape(w.shape)
    return q, scale.squeeze(-1).half()


def _grouped8_blocks(blocks: torch.Tensor, qtype: QType) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 `[n, block]`, scale float32 `[n, block / 32]`) of GROUPED8_EXACT blocks:
    w = scale · code per 32, as `dequantize` computes it."""
    n = blocks.shape[0]
    if qtype == QType.Q8_0:
        return blocks[:, 2:].contiguous().view(torch.int8), _f16(blocks, 0)
    if qtype == QType.IQ4_NL:
        return _iq4_levels(_nibbles(blocks[:, 2:])).to(torch.int8), _f16(blocks, 0)
    if qtype == QType.IQ4_XS:
        high = blocks[:, 2].to(torch.int32) | (blocks[:, 3].to(torch.int32) << 8)
        shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=blocks.device)
        scales_l = torch.cat((blocks[:, 4:8, None] & 0x0F, blocks[:, 4:8, None] >> 4), dim=2)
        ls = (scales_l.reshape(n, 8).to(torch.int32) | (((high[:, None] >> shifts) & 3) << 4)) - 32
        qs = blocks[:, 8:].reshape(n, 8, 1, 16)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, QK_K)
        return _iq4_levels(q).to(torch.int8), _f16(blocks, 0) * ls.float()
    # Q3_K: dequantize's q and sub-block scales, multiplied as integers
    d = _f16(blocks, 108)
    per16 = _dequant_q3_k_codes(blocks)  # [n, 16, 16] int32: (sc - 32) · q
    codes = per16.clamp(-127, 127).to(torch.int8).reshape(n, QK_K)
    return codes, d.expand(n, QK_K // 32)


def int8_codes(
    raw: torch.Tensor, qtype: QType, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A GROUPED8 tensor as int8 codes `[out, in]` and a float16 scale per 32 `[out, in / 32]`
    for the native kernel's grouped int8 layer: GROUPED8_EXACT's own integers (the scale
    rounded to float16 where it is a product: IQ4_XS's d · (ls - 32)), the others on `grid8`
    of their dequantised values."""
    if qtype not in GROUPED8:
        raise ValueError(f"{qtype.name} has no int8 codes per 32")
    out_f, in_f = shape
    type_size = _block_bytes(qtype, shape)
    if qtype not in GROUPED8_EXACT:
        return grid8(dequantize(raw, qtype, shape))
    q, scale = _grouped8_blocks(raw.reshape(-1, type_size), qtype)
    return q.reshape(out_f, in_f), scale.reshape(out_f, in_f // 32).half()
