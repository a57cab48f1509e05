"""Built weight modules → a plain tree plus a list of tensors, and back (the weight cache's
content, `weight_cache`).

Why a tree of attributes and not a recorded recipe: a packed layer (`linear.Q4Linear`, …) is
built by its constructor from the loader's float32 weight, which is the expensive part to
redo; the cache must restore the *built* layer without it, and without knowing each class
(new kernels add classes). So `encode` records a module's class, its buffers and its plain
attributes, and `decode` restores them on an object made by `cls.__new__`, skipping
`__init__`.

That is only sound when every attribute is plain data. What is not:
- the native kernel module and its functions (`Q4Linear._matmul`): recorded by name and
  looked up again (`packing.native_kernel()`);
- raw pointers to the module's own tensors (`Q4Linear._pointers`, their `data_ptr()`s, which
  the kernel is called with): an int that is the start of a tensor of the same snapshot is
  re-pointed at the restored tensor, whatever its size (a small tensor from the C heap of a
  non-PIE interpreter lies below 4 GiB). Refused (`UncacheableError`, and the loader keeps
  its uncached path): an int inside a recorded tensor but not at its start, any other int of
  2**32 or more (an address of something not recorded), an int64 tensor that holds a
  tensor's address, a Python callable, a hook, a parameter, an overlapping view. A wrong
  pointer would crash the process; refusing costs only the cache.
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from neuron_trio.engine.model import packing

# Classes a snapshot may name: the project's own modules and torch's.
_ALLOWED_MODULE_PREFIXES = ("neuron_trio.", "torch.nn.")
_POINTER_MIN = 1 << 32  # an int this large is taken for an address (it must be a tensor's)
_NO_ADDRESS_BELOW = 1 << 16  # Linux maps nothing there (vm.mmap_min_addr): sizes, flags
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_SIMPLE = (bool, int, float, str, type(None))


class UncacheableError(Exception):
    """Raised by `encode` if a module holds something a snapshot cannot restore safely."""


class SnapshotError(Exception):
    """Raised by `decode` if a snapshot does not describe modules this build can restore."""


@dataclass
class Snapshot:
    """Slots (name → encoded module or tensor) and the distinct tensors they refer to."""

    slots: dict[str, Any] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)
    _index: dict[tuple[int, torch.dtype, tuple[int, ...]], int] = field(default_factory=dict)
    _storages: dict[int, int] = field(default_factory=dict)  # storage address → tensor index
    _starts: dict[int, int] = field(default_factory=dict)  # data address → tensor index

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

    def check_pointers(self) -> None:
        """UncacheableError if an int64 tensor holds the address of a recorded tensor (a table
        of pointers would come back stale). Call once every slot is added."""
        addresses = torch.tensor([t.data_ptr() for t in self.tensors if t.numel()])
        if not len(addresses):
            return
        for t in self.tensors:
            words = t.dtype in (torch.int64, torch.uint64) and t.numel()
            if words and bool(torch.isin(t.reshape(-1).to(torch.int64), addresses).any()):
                raise UncacheableError("an int64 tensor holds a tensor's address")

    # ---- encoding ----------------------------------------------------------------------

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
            return found
        storage = t.untyped_storage().data_ptr() if t.numel() else 0
        if storage and storage in self._storages:
            raise UncacheableError("two different views of one storage")
        index = len(self.tensors)
        self.tensors.append(t)
        self._index[key] = index
        self._starts.setdefault(t.data_ptr(), index)
        if storage:
            self._storages[storage] = index
        return index

    def _int(self, value: int) -> list[Any]:
        """A plain int, or a pointer to a recorded tensor (re-pointed when restored)."""
        if abs(value) < _NO_ADDRESS_BELOW:
            return ["v", value]
        index = self._starts.get(value)
        if index is not None:
            return ["ptr", index]
        for t in self.tensors:
            start = t.data_ptr()
            if start < value < start + t.numel() * t.element_size():
                raise UncacheableError(f"an int {value:#x}: an address inside a tensor")
        if abs(value) >= _POINTER_MIN:
            raise UncacheableError(f"an int {value:#x} that is no recorded tensor's address")
        return ["v", value]

    def _value(self, value: Any) -> list[Any]:
        kernel = packing.native_kernel()
        if isinstance(value, bool) or value is None or isinstance(value, float | str):
            return ["v", value]
        if isinstance(value, int):
            return self._int(value)
        if isinstance(value, torch.Tensor):
            return ["tensor", self._tensor(value)]
        if isinstance(value, torch.dtype):
            return ["dtype", str(value).removeprefix("torch.")]
        if isinstance(value, torch.device):
            return ["device", str(value)]
        if isinstance(value, tuple | list):
            kind = "tuple" if isinstance(value, tuple) else "list"
            return [kind, [self._value(v) for v in value]]
        if kernel is not None and value is kernel:
            return ["kernel"]
        if (
            kernel is not None
            and isinstance(value, types.BuiltinFunctionType)
            and value.__self__ is kernel
        ):
            return ["kernel_fn", value.__name__]
        if isinstance(value, nn.Module):
            return self._module(value)
        raise UncacheableError(f"an attribute of type {type(value).__name__}")

    def _module(self, module: nn.Module) -> list[Any]:
        cls = type(module)
        if not cls.__module__.startswith(_ALLOWED_MODULE_PREFIXES):
            raise UncacheableError(f"a module of class {cls.__module__}.{cls.__qualname__}")
        state = module.__dict__
        if module._parameters:
            raise UncacheableError(f"{cls.__name__} has parameters")
        hooks = [k for k in _MODULE_INTERNALS if k.startswith("_") and "hook" in k]
        if any(state.get(k) for k in hooks):
            raise UncacheableError(f"{cls.__name__} has hooks")
        buffers = {
            name: None if t is None else self._tensor(t) for name, t in module._buffers.items()
        }
        children = {name: self._module(m) for name, m in module._modules.items() if m is not None}
        # attributes after the tensors: a pointer attribute refers to one of them
        attrs = {name: self._value(v) for name, v in state.items() if name not in _MODULE_INTERNALS}
        return [
            "module",
            {
                "cls": f"{cls.__module__}:{cls.__qualname__}",
                "training": module.training,
                "buffers": buffers,
                "non_persistent": sorted(module._non_persistent_buffers_set),
                "modules": children,
                "attrs": attrs,
            },
        ]

    def _encode(self, value: nn.Module | torch.Tensor) -> list[Any]:
        if isinstance(value, torch.Tensor):
            return ["tensor", self._tensor(value)]
        return self._module(value)


def decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    """A slot of a snapshot back as a module or tensor, over `tensors` (restored in the
    snapshot's order). SnapshotError if it names what this build does not have."""
    try:
        return _Decoder(tensors).value(node)
    except SnapshotError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, ImportError) as exc:
        raise SnapshotError(f"{type(exc).__name__}: {exc}") from None


class _Decoder:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.kernel = packing.native_kernel()

    def value(self, node: Any) -> Any:
        kind = node[0]
        if kind == "v":
            if not isinstance(node[1], _SIMPLE):
                raise SnapshotError(f"a value of type {type(node[1]).__name__}")
            return node[1]
        if kind == "tensor":
            return self.tensors[node[1]]
        if kind == "ptr":
            return self.tensors[node[1]].data_ptr()
        if kind == "dtype":
            dtype = getattr(torch, node[1])
            if not isinstance(dtype, torch.dtype):
                raise SnapshotError(f"{node[1]!r} is not a dtype")
            return dtype
        if kind == "device":
            return torch.device(node[1])
        if kind in ("tuple", "list"):
            items = [self.value(v) for v in node[1]]
            return tuple(items) if kind == "tuple" else items
        if kind in ("kernel", "kernel_fn"):
            if self.kernel is None:
                raise SnapshotError("the snapshot needs the native kernel, which is not here")
            return self.kernel if kind == "kernel" else getattr(self.kernel, node[1])
        if kind == "module":
            return self.module(node[1])
        raise SnapshotError(f"unknown node {kind!r}")

    def module(self, spec: dict[str, Any]) -> nn.Module:
        module_name, _, qualname = spec["cls"].partition(":")
        if not module_name.startswith(_ALLOWED_MODULE_PREFIXES):
            raise SnapshotError(f"class {spec['cls']} is not one a snapshot may name")
        cls: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise SnapshotError(f"{spec['cls']} is not a module class")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.training = bool(spec["training"])
        for name, index in spec["buffers"].items():
            module._buffers[name] = None if index is None else self.tensors[index]
        module._non_persistent_buffers_set.update(spec["non_persistent"])
        for name, child in spec["modules"].items():
            module._modules[name] = self.value(child)
        for name, value in spec["attrs"].items():
            module.__dict__[name] = self.value(value)
        return module
