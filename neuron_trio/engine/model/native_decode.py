"""Every layer of a decode step in one native call: the kernel's `decode_layers`
(`_cpu_layers.c`), from a plan of each layer's weights, norms and cache built here once.

Why: on 2 cores, Python and torch between the kernels of `Block.steps` took ~80 us a layer,
a third of a batch-1 decode step of the built-in model. The loop in C makes the same kernel
calls in the same order (same products and prologues, QK-norm in the RoPE call, the same
attention, float32 residual adds), so its logits are the Python path's bit for bit; the tests
hold it to that.

`Transformer.forward_steps` asks `DecodePlan.run` first for a step of decode rows and takes
the Python path when it answers None: a model or a step it does not take (tensor-parallel
shards, layers without the native kernel, soft-capped scores, 48 rows or more where the
layers switch to their dense copies).
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from neuron_trio.engine.model.kv_cache import KVCache
from neuron_trio.engine.model.linear import NATIVE_DENSE_MIN_ROWS, NativeLinear, StackedLinear
from neuron_trio.engine.model.placement import Placement

_ACT_DTYPES = (torch.bfloat16, torch.float32)


def _double_bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _parts(layer: Any) -> list[NativeLinear] | None:
    """The block's projections as the plan's five parts (Q/K/V, its second part or None, the
    attention output, gate and up, down), or None when one is not in the native kernel."""
    wqkv = layer.wqkv
    qkv: list[Any] = list(wqkv.parts) if isinstance(wqkv, StackedLinear) else [wqkv]
    parts = [*qkv, *([None] * (2 - len(qkv))), layer.wo, layer.w_gate_up, layer.w_down]
    if len(qkv) > 2 or not all(isinstance(p, NativeLinear) for p in parts if p is not None):
        return None
    return parts  # type: ignore[return-value]


class DecodePlan:
    """The plan of one model (`plan_for`): per layer the kernel's LAYER_FIELDS int64."""

    def __init__(self, model: Any, kernel: Any) -> None:
        self.model = model
        self.kernel = kernel
        self.part_fields, self.n_parts, self.layer_fields = kernel.layer_fields()
        self._plan: torch.Tensor | None = None
        self._key: tuple[int, ...] = ()

    @staticmethod
    def takes(model: Any) -> bool:
        """Whether this model's layers can run in the loop (checked once, at the first step)."""
        kernel, c = model.native_kernel, model.config
        if kernel is None or not hasattr(kernel, "decode_layers") or model.partial_sums:
            return False
        act = model.act_dtype
        if act not in _ACT_DTYPES or model.residual_dtype != torch.float32:
            return False
        d, h, kv = c.head_dim, c.n_heads, c.n_kv_heads
        if d % 16 or d > 256 or h % kv or h // kv > 16 or c.attn_softcap:
            return False
        if c.dim % 32 or c.ffn_dim % 32 or (h * d) % 32:
            return False
        for layer in model.layers:
            parts = _parts(layer)
            if parts is None or layer.attend_kernel is None:
                return False
            wo = layer.wo
            if getattr(wo, "out_dtype", None) not in (None, act) or not getattr(
                wo, "keep_dtype", True
            ):
                return False  # its output would not be in `act`, as the loop writes it
            bias = layer.qkv_bias
            if bias is not None and bias.dtype != act:
                return False
            norms = (layer.attn_norm, layer.ffn_norm, layer.post_attn_norm, layer.post_ffn_norm)
            if any(n is not None and n.dtype != torch.float32 for n in norms):
                return False
        return True

    def _build(self, kv: KVCache) -> torch.Tensor:
        model, c = self.model, self.model.config
        cos, sin = model.rope_f32
        cos_local, sin_local = model.rope_f32_local if c.has_local_rope else model.rope_f32
        rows = []
        for layer, cache in zip(model.layers, kv.layers, strict=True):
            parts = _parts(layer)
            assert parts is not None
            fields: list[int] = []
            for part in parts:
                fields += [0] * self.part_fields if part is None else part.plan_part()
            sliding = bool(layer.sliding)
            qk = layer.qk_norm_f32() if layer.qk_norm is not None else None
            fields += [
                _address(layer.attn_norm), _address(layer.ffn_norm), _address(layer.qkv_bias),
                _address(qk), _address(layer.post_attn_norm), _address(layer.post_ffn_norm),
                cache.data_ptr(),
                (cos_local if sliding else cos).data_ptr(),
                (sin_local if sliding else sin).data_ptr(),
                int(layer.gelu), int(sliding), _double_bits(layer.eps),
                _double_bits(layer.scale or 0.0),
            ]  # fmt: skip
            assert len(fields) == self.layer_fields
            rows.append(fields)
        return torch.tensor(rows, dtype=torch.int64)

    def run(self, x: torch.Tensor, at: Placement, kv: KVCache) -> torch.Tensor | None:
        """Every layer over the step's decode rows (x `[N, dim]` float32, updated in place and
        returned), or None when this step is not one the loop takes."""
        model, c = self.model, self.model.config
        n = x.shape[0]
        if at.t != 1 or at.real is not None or at.positions is None or at.write_rows is None:
            return None
        if n >= NATIVE_DENSE_MIN_ROWS:
            return None
        cache, act = kv.layers[0], model.act_dtype
        if cache.dtype != act or not cache.is_contiguous():
            return None
        masks = (at.mask, at.window_mask)
        if not all(m is None or _additive_row_mask(m, act) for m in masks):
            return None
        (mask, mask_stride), (window, window_stride) = (_mask_args(m) for m in masks)
        rows = at.token_rows
        if rows is None:
            if not isinstance(at.read, slice):
                return None
            rows = torch.arange(at.read.start, at.read.stop, dtype=torch.int64).view(1, -1)
        key = (cache.data_ptr(), model.rope_f32[0].data_ptr(), model.rope_f32_local[0].data_ptr())
        if self._plan is None or key != self._key:
            self._plan, self._key = self._build(kv), key
        x = x.contiguous()
        flags = 3 if act == torch.bfloat16 else 0
        self.kernel.decode_layers(
            self._plan.data_ptr(), c.n_layers, x.data_ptr(), n, c.dim, c.n_heads,
            c.n_kv_heads, c.head_dim, c.ffn_dim, flags, cache.shape[1],
            at.positions.data_ptr(), at.write_rows.data_ptr(), rows.data_ptr(), at.length,
            mask, mask_stride, window, window_stride, at.window_start,
            0 if at.row_ends is None else at.row_ends.data_ptr(),
        )  # fmt: skip
        return x


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _additive_row_mask(mask: torch.Tensor, act: torch.dtype) -> bool:
    """An additive mask of a row's keys, `[B or 1, 1, 1, L]` in `act`: what the loop takes."""
    return (
        mask.dtype == act and mask.dim() == 4 and mask.shape[1:3] == (1, 1) and mask.stride(-1) == 1
    )


def _mask_args(mask: torch.Tensor | None) -> tuple[int, int]:
    """A mask's address and row stride for the kernel (0, 0: none; stride 0: one row for all)."""
    if mask is None:
        return 0, 0
    return mask.data_ptr(), mask.stride(0) if mask.shape[0] > 1 else 0


def plan_for(model: Any) -> DecodePlan | None:
    """The model's plan (made at its first decode step and kept in `model._decode_plan`), or
    None when its layers need Python. A `_decode_plan` of None keeps a model on the Python
    path (the tests and bench_native_decode.py compare the two); False: not decided yet."""
    plan = model._decode_plan
    if plan is False:
        plan = DecodePlan(model, model.native_kernel) if DecodePlan.takes(model) else None
        model._decode_plan = plan
    return plan if isinstance(plan, DecodePlan) else None
