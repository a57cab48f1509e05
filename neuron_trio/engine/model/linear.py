"""The projections of a transformer: one interface (`LinearLayer`), one class per kernel.

`Linear` (a dense weight), torch's weight-only `Int4Linear`/`Int8Linear`, the native kernel's
`Q4Linear` (4- or 5-bit, with RMSNorm or the gate's activation fused in at decode) and
`Q8Linear` (int8, one scale per row: the output head's coarse pass, and weights in 6- and
8-bit formats), `StackedLinear` (one projection whose rows are held by layers of different
kernels), and `RefinedHead` (a coarse pass, then each row's best logits exact). The loader
(`engine.model.load.loader`) picks one per weight; `Block` calls the interface only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.layer_parts import (
    LayerParts,
    dtype_name,
    dtype_of,
    expect,
    int_field,
)

# What the weight cache may keep (module_codec.py): each class says what it is made of
# (`parts`) and is built again from that by its own constructor (`from_parts`), which checks
# the tensors against its fields. Every method here is short; the checks are the point.


class LinearLayer(nn.Module):
    """The one interface of a projection, whichever kernel holds its weight.

    `forward(x)` is the product. `normed` and `gated` are the product after the op that always
    precedes it in a block (RMSNorm; the gate's activation times the up projection): here in
    torch, while the kernel that fuses them (NativeLinear: Q4Linear, Q8Linear) overrides
    them. So `Block` calls the same three methods on every projection and never asks which
    kernel it holds.
    """

    in_features: int
    out_features: int
    # The rows at or above which `forward` takes the layer's dense copy (a `dense` buffer),
    # where it keeps one: below them its int kernel. None: no such switch.
    DENSE_FROM_ROWS: int | None = None

    def normed(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        act: torch.dtype,
        out: torch.dtype | None = None,
    ) -> torch.Tensor:
        """RMSNorm(x) · weight in `act`, then the product: x `[N, in]`. `out` is the dtype a
        fused kernel writes its result in (its own default: `act`); an unfused layer's
        product keeps its natural dtype."""
        return self.forward(F.rms_norm(x, (x.shape[-1],), weight, eps).to(act))

    def gated(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        """act(gate) · up, then the product: gate_up `[N, 2 · in]` (SiLU, or GELU-tanh)."""
        ffn = gate_up.shape[-1] // 2
        gate = gate_up[:, :ffn]
        gate = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        return self.forward(gate * gate_up[:, ffn:])


class Linear(LinearLayer):
    """y = x · Wᵀ with a dense weight `[out, in]` (float32, bfloat16 or float16)."""

    weight: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._buffers["weight"])  # type: ignore[arg-type]

    def layer_parts(self) -> LayerParts:
        return LayerParts({"weight": self._buffers["weight"]})

    @classmethod
    def from_parts(cls, parts: LayerParts, kernel: Any = None) -> Linear:
        weight = parts.tensors["weight"]
        if weight is None or weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError("weight: not a 2-D floating-point tensor")
        return cls(weight)


# At or above this many rows (prefill chunks), the int kernels lose to a dense GEMM: layers
# that keep a dense copy use it (measured on 2 CPU cores: int4 at 256 rows ~4x slower).
DENSE_MIN_ROWS = 16
# The native kernel (Q4Linear) holds out longer: on 2 cores it beat the dense bfloat16 copy
# by 1.5x at 16 rows and 1.2x at 32-48, and lost from 64-96 rows on (bench: the products of
# the built-in model's 30 layers at N rows, both ways).
NATIVE_DENSE_MIN_ROWS = 48

_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu
_INT8_MM = torch.ops.aten._weight_int8pack_mm


def dense_prefill_rows(model: nn.Module) -> int | None:
    """The fewest rows of a forward at which one of `model`'s projections leaves its int
    kernel for its dense copy (DENSE_FROM_ROWS), or None where none keeps a copy: then a
    forward of any number of rows runs the same kernels. (The native layers' RMSNorm and
    gate move from the kernel's prologue to torch at NATIVE_DENSE_MIN_ROWS rows either way;
    those ops cost nothing more on their first call: Qwen2.5 0.5B's first 48-row prefill took
    the same 0.43 s whether a 48-row prefill had run before or not.)"""
    rows = [
        m.DENSE_FROM_ROWS
        for m in model.modules()
        if isinstance(m, LinearLayer)
        and m.DENSE_FROM_ROWS is not None
        and m._buffers.get("dense") is not None
    ]
    return min(rows, default=None)


class Int4Linear(LinearLayer):
    """Weight-only int4 (groups of `group` inputs) through torch's CPU kernel; bf16 in and out.

    With `dense` (a bfloat16 copy of the weight), inputs of DENSE_MIN_ROWS rows or more take a
    dense GEMM instead.
    """

    dense: torch.Tensor | None
    DENSE_FROM_ROWS = DENSE_MIN_ROWS

    def __init__(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        out_f: int,
        in_f: int,
        group: int,
        dense: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)  # [in/group, out, 2]
        self.register_buffer("dense", dense)
        self.out_features, self.in_features, self.group = out_f, in_f, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Buffers straight from `_buffers` (nn.Module.__getattr__ costs ~0.5 us a lookup, and
        # a decode step makes 120 of these calls); 2-D input, as Block passes, needs no reshape.
        buffers = self._buffers
        dense = buffers["dense"]
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self.forward(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)
        if dense is not None and x.shape[0] >= DENSE_MIN_ROWS:
            return F.linear(x.to(dense.dtype), dense).to(x.dtype)
        return _INT4_MM(x, buffers["packed"], self.group, buffers["scales_zeros"])

    def layer_parts(self) -> LayerParts:
        fields = {"out_f": self.out_features, "in_f": self.in_features, "group": self.group}
        names = ("packed", "scales_zeros", "dense")
        return LayerParts({n: self._buffers[n] for n in names}, fields)

    @classmethod
    def from_parts(cls, parts: LayerParts, kernel: Any = None) -> Int4Linear:
        t, f = parts.tensors, parts.fields
        out_f, in_f, group = (int_field(f, n) for n in ("out_f", "in_f", "group"))
        if out_f <= 0 or in_f <= 0 or group <= 0 or in_f % group:
            raise ValueError(f"shape {out_f} x {in_f} in groups of {group}")
        packed, scales_zeros = t["packed"], t["scales_zeros"]
        if packed is None or packed.numel() * packed.element_size() != out_f * in_f // 2:
            raise ValueError("packed: not out x in / 2 bytes")  # torch's op checks its shape
        expect(scales_zeros, "scales_zeros", torch.bfloat16, (in_f // group, out_f, 2))
        _expect_dense(t["dense"], out_f, in_f)
        return cls(packed, scales_zeros, out_f, in_f, group, t["dense"])  # type: ignore[arg-type]


# The native kernel's prologues (see _cpu_kernel.c): what it does to x before the product.
_PRO_NONE, _PRO_RMSNORM, _PRO_SILU, _PRO_GELU = 0, 1, 2, 3


class NativeLinear(LinearLayer):
    """A projection in the native kernel (`_cpu_kernel.c`, see packing.native_kernel): its
    `normed` and `gated` run the layer's RMSNorm or SwiGLU/GeGLU inside the kernel, which
    saves a decode step ~16 torch ops a layer. Inputs of NATIVE_DENSE_MIN_ROWS rows or more
    (or in dtypes the kernel does not take) go through torch and `forward` instead.
    """

    DENSE_FROM_ROWS = NATIVE_DENSE_MIN_ROWS

    def normed(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        act: torch.dtype,
        out: torch.dtype | None = None,
    ) -> torch.Tensor:
        """RMSNorm(x) · weight, then the product, as `out` (default `act`): x `[N, in]` and
        weight float32; in the kernel unless the rows are many or the dtypes are not its."""
        out = act if out is None else out
        if (
            x.shape[0] >= NATIVE_DENSE_MIN_ROWS
            or x.dtype != torch.float32
            or weight.dtype != x.dtype
        ):
            return self.forward(F.rms_norm(x, (self.in_features,), weight, eps).to(out))
        return self._product(x, out, _PRO_RMSNORM, weight.data_ptr(), eps)

    def gated(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        """act(gate) · up, then the product: gate_up `[N, 2 · in]` (SiLU, or GELU-tanh)."""
        if gate_up.shape[0] >= NATIVE_DENSE_MIN_ROWS:
            gate, up = gate_up[:, : self.in_features], gate_up[:, self.in_features :]
            gate = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
            return self.forward(gate * up)
        return self._product(gate_up, gate_up.dtype, _PRO_GELU if gelu else _PRO_SILU)

    def _product(
        self, x: torch.Tensor, out: torch.dtype, prologue: int = 0, aux: int = 0, eps: float = 0.0
    ) -> torch.Tensor:
        raise NotImplementedError

    def plan_part(self) -> list[int]:
        """This projection as a part of native_decode's plan: weights, scales, minimums (0:
        int8), fifth bits, group sums, outputs, flags (the kernel's PART_FIELDS)."""
        raise NotImplementedError

    # the buffers a product reads, in the order it reads them (arena.gather lays them out so)
    KERNEL_BUFFERS: tuple[str, ...] = ()

    def kernel_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The KERNEL_BUFFERS this projection holds (a centred or coarse one has no minimum,
        a 4-bit one no fifth bits), by name, in that order."""
        return [(n, t) for n in self.KERNEL_BUFFERS if (t := self._buffers.get(n)) is not None]

    def move_kernel_buffers(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Give each of KERNEL_BUFFERS the copy `place` returns (the same values elsewhere),
        then take the new addresses. Only between steps: the kernel reads them by address."""
        for name, t in self.kernel_tensors():
            self._buffers[name] = place(t)
        self._take_pointers()

    def _take_pointers(self) -> None:
        raise NotImplementedError


class Q4Linear(NativeLinear):
    """Weight-only 4-bit groups of 32 through the native kernel (`_cpu_kernel.c`, see
    packing.native_kernel): int8 activations and integer dot products, as llama.cpp on the same CPU.
    Input and output in the input's dtype (bfloat16 or float32; `out_dtype` fixes it); CPU
    only. With `high` (the fifth bits `[out, in]`, 0/1: packing.pack_q5) the codes are 5-bit
    (Q5_0, Q5_1 weights); then a `minimum` of None means -16 · scale (Q5_0's centred codes,
    which the kernel then need not read: ~8% fewer bytes a step). With `one_pass` the kernel
    quantises the input to int8 once, without the residual pass that makes its products
    nearly float32's: half the dot products, for a coarse pass whose best outputs are
    recomputed exactly (RefinedHead's). `coarse` goes further for that pass: the weights are
    packing.pack_q4_symmetric's (a `minimum` of None) and the input has one int8 scale per
    row, so the kernel spends one float multiply-add a group instead of four (Qwen2.5's
    151,936 x 896 at batch 8: 5.1 -> 4.5 ms). On the parity prompts the exact best logit
    stayed within the coarse pass's 4 best (12 on Gemma 3), far inside the 256 that
    RefinedHead recomputes.

    With `dense` (a bfloat16 copy of the weight), inputs of NATIVE_DENSE_MIN_ROWS rows or more
    take a dense GEMM instead (after the same ops in torch).
    """

    dense: torch.Tensor | None

    def __init__(
        self,
        kernel: Any,
        nibbles: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor | None,
        dense: torch.Tensor | None = None,
        high: torch.Tensor | None = None,
        *,
        out_dtype: torch.dtype | None = None,
        one_pass: bool = False,
        coarse: bool = False,
        tiled: bool = False,
    ) -> None:
        """`tiled`: the tensors are already in the kernel's tiles (from_parts: the weight
        cache's), checked against each other instead of tiled."""
        super().__init__()
        self.kernel = kernel  # RefinedHead's refinement runs in it too (a coarse head)
        self.out_dtype = out_dtype
        centred = minimum is None and not coarse
        if coarse and (minimum is not None or high is not None):
            raise ValueError("the coarse kind is pack_q4_symmetric's: no minimum, no fifth bits")
        if centred and high is None:
            raise ValueError("a minimum of None is for 5-bit codes (Q5_0) or `coarse` only")
        if tiled:
            self.out_features, self.in_features = _check_q4_tiles(nibbles, scale, minimum, high)
            tiled_high = high
        else:
            self.out_features, self.in_features = scale.shape[0], nibbles.shape[1] * 2
            # pack_q4's layout ([out, in / 2] nibbles, [out, in / 32] scales) in the kernel's
            # tiles; a centred or coarse layer's "minimum" is its scale (a valid address the
            # kernel never reads)
            nibbles, scale, minimum = packing.tile_q4(
                nibbles, scale, scale if minimum is None else minimum
            )
            tiled_high = None if high is None else packing.tile_high(high)
        _expect_dense(dense, self.out_features, self.in_features)
        # the kernel's FLAG_CENTRED, FLAG_ONE_PASS and FLAG_COARSE (which implies one pass)
        self._flags = (4 if centred else 0) | (8 if one_pass or coarse else 0) | (32 * coarse)
        self.register_buffer("nibbles", nibbles)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", None if centred or coarse else minimum)
        self.register_buffer("high", tiled_high)
        self.register_buffer("dense", dense)
        self._matmul = kernel.matmul
        self._take_pointers()

    KERNEL_BUFFERS = ("nibbles", "high", "scale", "minimum")

    def drop_residual_pass(self) -> None:
        """From now on one int8 pass of the input in the kernel, as `one_pass` (a dense copy's
        prefill rows are unchanged); for bench/bench_decode.py's `--one-pass`: what the
        residual pass costs in speed and buys in agreement. Before the first step only: a
        decode plan already built keeps the flags it read."""
        self._flags |= 8

    def _take_pointers(self) -> None:
        # The buffers move only through move_kernel_buffers (CPU only): their addresses once
        # then, not per call.
        buffers = self._buffers
        nibbles, high, scale, minimum = (buffers[n] for n in self.KERNEL_BUFFERS)
        assert nibbles is not None and scale is not None
        self._pointers = (
            nibbles.data_ptr(),
            scale.data_ptr(),
            (scale if minimum is None else minimum).data_ptr(),
        )
        self._high = 0 if high is None else high.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self.forward(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)
        dense = self._buffers["dense"]
        out = x.dtype if self.out_dtype is None else self.out_dtype
        if dense is not None and x.shape[0] >= NATIVE_DENSE_MIN_ROWS:
            return F.linear(x.to(dense.dtype), dense).to(out)
        return self._product(x, out)

    def _product(
        self, x: torch.Tensor, out: torch.dtype, prologue: int = 0, aux: int = 0, eps: float = 0.0
    ) -> torch.Tensor:
        if x.dtype not in (torch.bfloat16, torch.float32):
            x = x.float()
        x = x.contiguous()
        n = x.shape[0]
        y = torch.empty(n, self.out_features, dtype=out)
        # bit 0: x in bfloat16, bit 1: y in bfloat16 (else float32), bit 2: centred 5-bit
        # codes, bit 3: one pass, bit 5: the coarse kind
        flags = int(x.dtype == torch.bfloat16) | 2 * int(out == torch.bfloat16) | self._flags
        qs, scale, minimum = self._pointers
        self._matmul(
            x.data_ptr(), n, self.in_features, qs, scale, minimum, self.out_features,
            y.data_ptr(), flags, prologue, aux, eps, self._high,
        )  # fmt: skip
        return y

    def plan_part(self) -> list[int]:
        qs, scale, minimum = self._pointers
        return [qs, scale, minimum, self._high, 0, self.out_features, self._flags]

    def layer_parts(self) -> LayerParts:
        fields = {
            "out_dtype": dtype_name(self.out_dtype),
            "one_pass": bool(self._flags & 8),
            "coarse": bool(self._flags & 32),
        }
        return LayerParts({n: self._buffers[n] for n in (*self.KERNEL_BUFFERS, "dense")}, fields)

    @classmethod
    def from_parts(cls, parts: LayerParts, kernel: Any = None) -> Q4Linear:
        if kernel is None:
            raise ValueError("Q4Linear needs the native kernel, which is not here")
        t, f = parts.tensors, parts.fields
        nibbles, scale = t["nibbles"], t["scale"]
        if nibbles is None or scale is None:
            raise ValueError("nibbles and scale are required")
        return cls(
            kernel, nibbles, scale, t["minimum"], t["dense"], t["high"],
            out_dtype=dtype_of(f["out_dtype"]), one_pass=bool(f["one_pass"]),
            coarse=bool(f["coarse"]), tiled=True,
        )  # fmt: skip


def _check_q4_tiles(
    nibbles: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
    high: torch.Tensor | None,
) -> tuple[int, int]:
    """(out, in) of tile_q4's (and tile_high's) tensors; ValueError unless every one has the
    dtype and shape the kernel reads for them."""
    tiles, groups = _tile_grid(nibbles, "nibbles")
    expect(nibbles, "nibbles", torch.uint8, (tiles, groups, 4, packing.Q4_TILE, 4))
    expect(scale, "scale", torch.float16, (tiles, groups, packing.Q4_TILE))
    if minimum is not None:
        expect(minimum, "minimum", torch.float16, (tiles, groups, packing.Q4_TILE))
    if high is not None:
        expect(high, "high", torch.uint8, (tiles, groups, 8, 4))
    return tiles * packing.Q4_TILE, groups * packing.INT4_GROUP


def _tile_grid(t: torch.Tensor, name: str) -> tuple[int, int]:
    """(tiles, groups) of a tensor in the kernel's 5-D tile layout; ValueError otherwise."""
    if t.dim() != 5:
        raise ValueError(f"{name}: {tuple(t.shape)} is not the kernel's 5-D tile layout")
    return int(t.shape[0]), int(t.shape[1])


def _expect_dense(dense: torch.Tensor | None, out_f: int, in_f: int) -> None:
    if dense is not None and (tuple(dense.shape) != (out_f, in_f) or not dense.is_floating_point()):
        raise ValueError(f"dense: {tuple(dense.shape)}, expected a float ({out_f}, {in_f})")


# The kernel's FLAG_GLU_ROUNDED for int8 layers: their SwiGLU of bfloat16 rows rounds as torch's
# did when it ran first. Measured on the parity prompts (top-1 agreement with float32, 192
# positions): a float32 SwiGLU cost Qwen2.5 0.5B one position (190 -> 189), rounding it kept
# 190; the same rounding of GeGLU cost Gemma 3 one (181 -> 180), so GeGLU stays float32.
_Q8_FLAGS = 16
# The kernel's FLAG_GROUPED (a float16 scale per row and group of 32) and FLAG_ONE_PASS
_GROUPED, _ONE_PASS = 64, 8


class Q8Linear(NativeLinear):
    """Weight-only int8 through the native kernel, int8 activations. With one float32 scale
    per row (`scale` `[out]`): the output head's coarse pass under "auto" (RefinedHead), and
    layers from float weights. With a float16 scale per row and group of 32 (`scale` `[out,
    in / 32]`, quant.int8_codes): the formats whose values are integers times a scale per 32
    (Q8_0, IQ4_NL, IQ4_XS, Q3_K, kept exactly) or fit an 8-bit grid per 32 (Q2_K, Q6_K), with
    two int8 passes of the activations as the 4-bit layers take (their products ~15 bits
    exact; `drop_residual_pass` for one). Output in float32 (the coarse logits of the tail
    are then not rounded to bfloat16's steps), or with `keep_dtype` in the input's (a layer
    in a block). With `dense` (a bfloat16 copy), inputs of NATIVE_DENSE_MIN_ROWS rows or more
    take a dense GEMM instead. `normed` and `gated` write the dtype asked for, as Q4Linear's.
    """

    dense: torch.Tensor | None

    def __init__(
        self,
        kernel: Any,
        weight: torch.Tensor,
        scale: torch.Tensor,
        dense: torch.Tensor | None = None,
        *,
        keep_dtype: bool = False,
        group_sums: torch.Tensor | None = None,
        one_pass: bool = False,
    ) -> None:
        """With `group_sums`, `weight` is already in the kernel's tiles (from_parts: the weight
        cache's), checked against the sums and scales instead of tiled."""
        super().__init__()
        self.keep_dtype = keep_dtype
        grouped = scale.dim() > 1
        if group_sums is not None:
            self.out_features, self.in_features = _check_q8_tiles(weight, scale, group_sums)
            tiled, sums = weight, group_sums
        else:
            self.out_features, self.in_features = weight.shape
            tiled, sums = packing.tile_q8(weight), packing.q8_group_sums(weight)
            if grouped:
                scale = scale.contiguous()
                expect(scale, "scale", torch.float16, (self.out_features, self.in_features // 32))
                scale = packing.tile_group_scales(scale)
            else:
                scale = scale.float().contiguous()
        self._flags = _Q8_FLAGS | (_GROUPED if grouped else 0) | (_ONE_PASS if one_pass else 0)
        _expect_dense(dense, self.out_features, self.in_features)
        self.register_buffer("dense", dense)
        self.register_buffer("weight", tiled)  # pack_q8's [out, in], in the kernel's tiles
        self.register_buffer("scale", scale)  # [out], or grouped [tiles, groups, 8]
        self.register_buffer("group_sums", sums)
        self.kernel = kernel  # RefinedHead's refinement runs in it too
        self._matmul = kernel.matmul
        self._take_pointers()

    KERNEL_BUFFERS = ("weight", "group_sums", "scale")

    def drop_residual_pass(self) -> None:
        """One int8 pass of the input from now on (as Q4Linear's; a scale per row has one)."""
        self._flags |= _ONE_PASS

    def _take_pointers(self) -> None:  # as Q4Linear's
        weight, sums, scale = (self._buffers[n] for n in self.KERNEL_BUFFERS)
        assert weight is not None and sums is not None and scale is not None
        self._pointers = (weight.data_ptr(), scale.data_ptr(), sums.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = self._buffers["dense"]
        if dense is not None and x.reshape(-1, self.in_features).shape[0] >= NATIVE_DENSE_MIN_ROWS:
            return F.linear(x.to(dense.dtype), dense).to(x.dtype)
        if x.dtype not in (torch.bfloat16, torch.float32):
            x = x.float()
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        y = self._product(x, x.dtype if self.keep_dtype else torch.float32)
        return y.reshape(*lead, self.out_features)

    def _product(
        self, x: torch.Tensor, out: torch.dtype, prologue: int = 0, aux: int = 0, eps: float = 0.0
    ) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=out)
        weight, scale, sums = self._pointers
        # bit 0: x in bfloat16, bit 1: y in bfloat16 (else float32), bit 3: one pass, bit 4: a
        # SwiGLU of bfloat16 rounded to it, as torch's was (_Q8_FLAGS), bit 6: grouped scales
        flags = int(x.dtype == torch.bfloat16) | 2 * int(out == torch.bfloat16) | self._flags
        self._matmul(
            x.data_ptr(), x.shape[0], self.in_features, weight, scale, 0, self.out_features,
            y.data_ptr(), flags, prologue, aux, eps, 0, sums,
        )  # fmt: skip
        return y

    def plan_part(self) -> list[int]:
        weight, scale, sums = self._pointers
        return [weight, scale, 0, 0, sums, self.out_features, self._flags]

    def layer_parts(self) -> LayerParts:
        names = (*self.KERNEL_BUFFERS, "dense")
        fields = {"keep_dtype": self.keep_dtype, "one_pass": bool(self._flags & _ONE_PASS)}
        return LayerParts({n: self._buffers[n] for n in names}, fields)

    @classmethod
    def from_parts(cls, parts: LayerParts, kernel: Any = None) -> Q8Linear:
        if kernel is None:
            raise ValueError("Q8Linear needs the native kernel, which is not here")
        t = parts.tensors
        weight, scale, sums = t["weight"], t["scale"], t["group_sums"]
        if weight is None or scale is None or sums is None:
            raise ValueError("weight, scale and group_sums are required")
        keep, one = bool(parts.fields["keep_dtype"]), bool(parts.fields.get("one_pass"))
        return cls(
            kernel, weight, scale, t["dense"], keep_dtype=keep, group_sums=sums, one_pass=one
        )


def _check_q8_tiles(
    weight: torch.Tensor, scale: torch.Tensor, sums: torch.Tensor
) -> tuple[int, int]:
    """(out, in) of tile_q8's weight with its scales (per row, or tile_group_scales') and
    q8_group_sums; ValueError unless each has the dtype and shape the kernel reads."""
    tiles, groups = _tile_grid(weight, "weight")
    expect(weight, "weight", torch.int8, (tiles, groups, 8, packing.Q4_TILE, 4))
    if scale.dim() > 1:
        expect(scale, "scale", torch.float16, (tiles, groups, packing.Q4_TILE))
    else:
        expect(scale, "scale", torch.float32, (tiles * packing.Q4_TILE,))
    expect(sums, "group_sums", torch.int32, (tiles, groups, packing.Q4_TILE))
    return tiles * packing.Q4_TILE, groups * packing.INT4_GROUP


class StackedLinear(LinearLayer):
    """One projection whose output rows are held by several layers, one after the other: a
    fused Q/K/V whose parts the file stores in different formats (Q5_0 Q and K with a Q8_0
    V), each part in its own kernel. Every part reads the same input; the outputs are joined
    in float32 unless all parts return one dtype."""

    def __init__(self, parts: list[LinearLayer]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _joined([part(x) for part in self.parts])

    def layer_parts(self) -> LayerParts:
        return LayerParts({}, children=tuple(self.parts))

    @classmethod
    def from_parts(cls, parts: LayerParts, kernel: Any = None) -> StackedLinear:
        layers = [c for c in parts.children if isinstance(c, LinearLayer)]
        if not layers or len(layers) != len(parts.children):
            raise ValueError("a stack of projections needs at least one, and only those")
        if any(layer.in_features != layers[0].in_features for layer in layers):
            raise ValueError("the parts of a stack read inputs of different widths")
        return cls(layers)

    def normed(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        act: torch.dtype,
        out: torch.dtype | None = None,
    ) -> torch.Tensor:
        return _joined([part.normed(x, weight, eps, act, out) for part in self.parts])  # type: ignore[operator]


def _joined(outputs: list[torch.Tensor]) -> torch.Tensor:
    dtypes = {y.dtype for y in outputs}
    if len(dtypes) > 1:
        outputs = [y.float() for y in outputs]
    return torch.cat(outputs, dim=-1)


class Int8Linear(LinearLayer):
    """Weight-only int8 (one scale per output row) through torch's CPU kernel; bf16 in.

    With `dense`, inputs of DENSE_MIN_ROWS rows or more take a dense GEMM in its dtype.
    """

    dense: torch.Tensor | None
    DENSE_FROM_ROWS = DENSE_MIN_ROWS

    def __init__(
        self, weight: torch.Tensor, scales: torch.Tensor, dense: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # int8 [out, in]
        self.register_buffer("scales", scales)  # [out]
        self.register_buffer("dense", dense)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers  # as in Int4Linear.forward
        dense = buffers["dense"]
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self.forward(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)
        if dense is not None and x.shape[0] >= DENSE_MIN_ROWS:
            return F.linear(x.to(dense.dtype), dense)
        return _INT8_MM(x, buffers["weight"], buffers["scales"])

    def layer_parts(self) -> LayerParts:
        return LayerParts({n: self._buffers[n] for n in ("weight", "scales", "dense")})

    @classmethod
    def from_parts(cls, parts: LayerParts, kernel: Any = None) -> Int8Linear:
        t = parts.tensors
        weight, scales = t["weight"], t["scales"]
        if weight is None or weight.dim() != 2 or weight.dtype != torch.int8:
            raise ValueError("weight: not a 2-D int8 tensor")
        expect(scales, "scales", torch.bfloat16, (weight.shape[0],))
        _expect_dense(t["dense"], weight.shape[0], weight.shape[1])
        return cls(weight, scales, t["dense"])  # type: ignore[arg-type]


class RefinedHead(nn.Module):
    """The output head under "auto" on CPU: a coarse pass over the whole vocabulary through a
    weight-only int kernel, then the `refine` best of each row recomputed exactly (float32)
    from the table `[V, dim]`.

    The table is float32, or (`q8_dim`: the row length) the file's own blocks `[V, bytes a
    row]` uint8 (Q8_0, or another block format: `qtype`), dequantised row by row where they
    are read: the same float32 values (quant.dequantize's products) in a quarter of the memory
    or less. A 262,144 x 640 table is 671 MB in float32, 178 MB as Q8_0, and a step reads only
    its candidates' rows. The native kernel's refine reads Q8_0 rows or float32; other
    formats take torch's topk, gather and bmm (a head that is not Q8_0 is rare, and its
    float32 table was 4 bytes a weight: 524 MB for a 32,000 x 4,096 Q6_K head).

    The int kernels return bfloat16 logits: steps of 1/16 at typical magnitudes, so close
    candidates tie and logprobs come out coarse. The candidates that decide greedy picks, the
    reported logprobs and most of the sampled mass get exact logits; the tail keeps the
    coarse ones. Rows of DENSE_MIN_ROWS or more (prefill with all logits) take the table.
    """

    table: torch.Tensor

    def __init__(
        self,
        coarse: nn.Module,
        table: torch.Tensor,
        refine: int,
        *,
        q8_dim: int = 0,
        qtype: quant.QType = quant.QType.Q8_0,
    ) -> None:
        super().__init__()
        self.coarse = coarse  # Q8Linear, Int8Linear or Int4Linear without a dense copy
        self.register_buffer("table", table)  # shared with the embedding when tied
        self.refine = refine
        self.q8_dim = q8_dim
        self.qtype = int(qtype)  # the blocks' format, with q8_dim
        self.out_features = table.shape[0]
        self.in_features = q8_dim or table.shape[1]
        # With a native coarse pass (and the table on the CPU), the kernel's `refine`: the k
        # best and their exact logits in one call, ~1 ms less a step at batch 8 than topk,
        # gather and bmm.
        q8 = bool(q8_dim) and qtype == quant.QType.Q8_0
        kinds = (torch.uint8,) if q8 else () if q8_dim else (torch.float32,)
        fits = table.dtype in kinds and table.is_contiguous() and table.device.type == "cpu"
        native = fits and isinstance(coarse, (Q8Linear, Q4Linear))
        self._kernel: Any = coarse.kernel if native else None

    def layer_parts(self) -> LayerParts:
        fields = {"refine": self.refine, "q8_dim": self.q8_dim, "qtype": self.qtype}
        return LayerParts({"table": self._buffers["table"]}, fields, (self.coarse,))

    @classmethod
    def from_parts(cls, parts: LayerParts, kernel: Any = None) -> RefinedHead:
        table, (coarse,) = parts.tensors["table"], parts.children
        refine, q8_dim = int_field(parts.fields, "refine"), int_field(parts.fields, "q8_dim")
        qtype = quant.QType(int_field(parts.fields, "qtype"))
        if table is None or table.dim() != 2:
            raise ValueError("table: not a 2-D tensor")
        vocab, dim = int(table.shape[0]), q8_dim or int(table.shape[1])
        if q8_dim:  # whole rows of q8_dim in blocks of `qtype`
            block, _ = quant.BLOCK_SIZES[qtype]
            if q8_dim % block:
                raise ValueError(f"rows of {q8_dim} are not whole blocks of {qtype.name}")
            expect(table, "table", torch.uint8, (vocab, quant.raw_nbytes(qtype, q8_dim)))
        if not 0 < refine <= vocab or not isinstance(coarse, LinearLayer):
            raise ValueError(f"refine {refine} of {vocab}, or a coarse pass that is no layer")
        if (coarse.out_features, coarse.in_features) != (vocab, dim):
            raise ValueError("the coarse pass and the table disagree on the head's shape")
        return cls(coarse, table, refine, q8_dim=q8_dim, qtype=qtype)

    def _rows(self, index: torch.Tensor | slice) -> torch.Tensor:
        """Table rows as float32 (or the dense table's dtype): `index` a tensor or a slice."""
        rows = self.table[index]
        if not self.q8_dim:
            return rows
        shape = (*rows.shape[:-1], self.q8_dim)
        return quant.dequantize(rows.contiguous(), quant.QType(self.qtype), shape)

    def _all_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every logit exact: the dense table, or Q8_0 rows dequantised a slice at a time
        (bounded memory: never the whole float32 table at once)."""
        if not self.q8_dim:
            return F.linear(x.to(self.table.dtype), self.table).float()
        x = x.float()
        step = 16384
        parts = [
            F.linear(x, self._rows(slice(v, v + step))) for v in range(0, self.out_features, step)
        ]
        return torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [N, dim]
        if x2.shape[0] >= DENSE_MIN_ROWS:
            return self._all_logits(x)
        logits = self.coarse(x2).float()  # [N, V]
        kernel = self._kernel
        if kernel is not None and x2.dtype in (torch.bfloat16, torch.float32):
            x2, logits = x2.contiguous(), logits.contiguous()
            n, vocab, dim = x2.shape[0], self.out_features, self.in_features
            bf16 = int(x2.dtype == torch.bfloat16)
            kernel.refine(
                logits.data_ptr(), n, vocab, x2.data_ptr(), bf16, self.table.data_ptr(), dim,
                self.refine, int(self.q8_dim > 0),
            )  # fmt: skip
            return logits.reshape(*lead, self.out_features)
        top = logits.topk(self.refine, dim=-1).indices  # [N, k]
        rows = self._rows(top)  # [N, k, dim]
        # each row's dot products on their own (not bmm, whose kernel and so whose sums'
        # order follow the batch): a row gets the same bits in a batch as alone, as the
        # kernel's refine gives them (a speculative verification's rows rely on it)
        exact = torch.stack([r @ v for r, v in zip(rows, x2.to(rows.dtype), strict=True)])
        logits.scatter_(1, top, exact.float())
        return logits.reshape(*lead, self.out_features)
