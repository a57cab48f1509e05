"""What a built layer is made of, for the packed-weight cache: its tensors, its plain fields and
its child layers. Each cacheable class (linear.py, embedding.py) says it (`parts`) and is
built again from it by its own constructor (`from_parts`), which checks every tensor's dtype
and shape against the fields before the kernel may read it: a cache file never hands a
layer a pointer, or a tensor shorter than the kernel will read (module_codec.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

Field = bool | int | float | str | None


@dataclass(frozen=True)
class LayerParts:
    tensors: Mapping[str, torch.Tensor | None]
    fields: Mapping[str, Field] = field(default_factory=dict)
    children: tuple[nn.Module, ...] = ()


def expect(t: torch.Tensor | None, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """ValueError unless `t` is a contiguous CPU tensor of `dtype` and `shape` (a layer's
    constructor, when it adopts tensors as they are)."""
    if t is None:
        raise ValueError(f"{name}: missing")
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.is_meta:
        raise ValueError(
            f"{name}: {t.dtype} {tuple(t.shape)}, expected a contiguous {dtype} {shape}"
        )


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def dtype_of(name: Field) -> torch.dtype | None:
    """The dtype a field names (None: none); ValueError for anything else."""
    if name is None:
        return None
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a dtype")
    return value


def int_field(fields: Mapping[str, Field], name: str) -> int:
    """Field `name` as an int; ValueError if it is missing or anything else."""
    value = fields.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: {value!r} is not an integer")
    return value
