"""Built weight modules ↔ typed nodes plus a list of tensors (the weight cache's content,
`weight_cache`).

A packed layer (`linear.Q4Linear`, …) is built from the loader's float32 weight, which is the
expensive part to redo; the cache must give back the *built* layer without it. Each class
the cache may hold (`CLASSES`) says what it is made of (`layer_parts()`: tensors, plain
fields, child layers) and is built again from that by its own constructor (`from_parts`),
which checks every tensor's dtype and shape against the fields before the kernel may read
it. So a node names a class from a fixed table (never an import path), tensors by index, and
fields of plain types; no address is stored (a layer takes its tensors' addresses itself),
and a file that does not fit the class is refused (SnapshotError: the loader packs again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgspec
import torch
from torch import nn

from neuron_trio.engine.model.embedding import QuantizedEmbedding
from neuron_trio.engine.model.linear import (
    Int4Linear,
    Int8Linear,
    Linear,
    Q4Linear,
    Q8Linear,
    RefinedHead,
    StackedLinear,
)
from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.layer_parts import Field, LayerParts

__all__ = [
    "CLASSES",
    "ModuleNode",
    "Node",
    "Snapshot",
    "SnapshotError",
    "TensorNode",
    "UncacheableError",
    "decode",
]


class Cacheable(Protocol):
    def layer_parts(self) -> LayerParts: ...


# The classes a snapshot may name, by name: the loader's layers and tables.
CLASSES: dict[str, Any] = {
    cls.__name__: cls
    for cls in (
        Linear,
        Int4Linear,
        Int8Linear,
        Q4Linear,
        Q8Linear,
        StackedLinear,
        RefinedHead,
        QuantizedEmbedding,
    )
}


class UncacheableError(Exception):
    """Raised by `Snapshot.add` if a value is not one a snapshot can hold (a class outside
    CLASSES, a tensor off the CPU, a parameter, two views of one storage)."""


class SnapshotError(Exception):
    """Raised by `decode` if a snapshot does not describe modules this build can restore."""


class TensorNode(msgspec.Struct, tag="tensor", forbid_unknown_fields=True):
    index: int


class ModuleNode(msgspec.Struct, tag="module", forbid_unknown_fields=True):
    cls: str
    tensors: dict[str, int | None]
    fields: dict[str, Field]
    children: list[ModuleNode | TensorNode] = msgspec.field(default_factory=list)


Node = ModuleNode | TensorNode


@dataclass
class Snapshot:
    """Slots (name → node) and the distinct tensors their nodes refer to."""

    slots: dict[str, Node] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)
    _index: dict[tuple[int, torch.dtype, tuple[int, ...]], int] = field(default_factory=dict)
    _storages: dict[int, int] = field(default_factory=dict)  # storage address → tensor index

    def add(self, name: str, value: nn.Module | torch.Tensor) -> None:
        """Record one slot (a built layer, or a table)."""
        self.slots[name] = self._encode(value)

    def replace_tensors(self, copies: dict[int, torch.Tensor]) -> None:
        """Record, instead of each tensor at an address in `copies`, its copy there (the same
        dtype, shape and values: arena.gather's), so that the old one can be freed. Call once
        every slot is added (the encoding's indices stay; its lookups by address do not)."""
        for i, t in enumerate(self.tensors):
            copy = copies.get(t.data_ptr())
            if copy is not None and copy.dtype == t.dtype and copy.shape == t.shape:
                self.tensors[i] = copy

    def _tensor(self, t: torch.Tensor) -> int:
        if t.device.type != "cpu" or t.is_meta:
            raise UncacheableError(f"a tensor on {t.device}")
        if isinstance(t, nn.Parameter) or t.requires_grad:
            raise UncacheableError("a parameter")
        if not t.is_contiguous():
            raise UncacheableError("a non-contiguous tensor")
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        found = self._index.get(key)
        if found is not None:
            return found  # one tensor in two places (a tied table): stored once, shared again
        storage = t.untyped_storage().data_ptr() if t.numel() else 0
        if storage and storage in self._storages:
            raise UncacheableError("two different views of one storage")
        index = len(self.tensors)
        self.tensors.append(t)
        self._index[key] = index
        if storage:
            self._storages[storage] = index
        return index

    def _encode(self, value: nn.Module | torch.Tensor) -> Node:
        if isinstance(value, torch.Tensor):
            return TensorNode(self._tensor(value))
        cls = type(value)
        if CLASSES.get(cls.__name__) is not cls:
            raise UncacheableError(f"a module of class {cls.__module__}.{cls.__qualname__}")
        parts = cast(Cacheable, value).layer_parts()
        tensors = {n: None if t is None else self._tensor(t) for n, t in parts.tensors.items()}
        for name, plain in parts.fields.items():
            if not isinstance(plain, bool | int | float | str | type(None)):
                raise UncacheableError(f"{cls.__name__}.{name}: a {type(plain).__name__}")
        children: list[Node] = [self._encode(child) for child in parts.children]
        return ModuleNode(cls.__name__, tensors, dict(parts.fields), children)


def decode(node: Node, tensors: list[torch.Tensor]) -> Any:
    """A slot of a snapshot back as a module (through its class's `from_parts`) or a tensor,
    over `tensors` (restored in the snapshot's order). SnapshotError if it names what this
    build does not have, or tensors that do not fit the class."""
    try:
        return _decode(node, tensors, packing.native_kernel())
    except SnapshotError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise SnapshotError(f"{type(exc).__name__}: {exc}") from None


def _decode(node: Node, tensors: list[torch.Tensor], kernel: Any) -> Any:
    if isinstance(node, TensorNode):
        return _at(tensors, node.index)
    cls = CLASSES.get(node.cls)
    if cls is None:
        raise SnapshotError(f"class {node.cls!r} is not one a snapshot may name")
    parts = LayerParts(
        {name: None if i is None else _at(tensors, i) for name, i in node.tensors.items()},
        node.fields,
        tuple(_decode(child, tensors, kernel) for child in node.children),
    )
    return cls.from_parts(parts, kernel)


def _at(tensors: list[torch.Tensor], index: int) -> torch.Tensor:
    if not 0 <= index < len(tensors):
        raise SnapshotError(f"tensor {index} of {len(tensors)}")
    return tensors[index]
