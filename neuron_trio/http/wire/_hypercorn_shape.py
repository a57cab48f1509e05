"""What hypercorn must look like for a fix to apply (`Fix`, `Patch`) and the checks each fix's
shape function makes of it: its methods, their parameters and the names their code uses,
the instance attributes `__init__` sets (see _hypercorn_fixes.py)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any, cast


def _names(code: CodeType) -> set[str]:
    """Every global and attribute name `code` refers to, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def method_problem(
    cls: type, name: str, params: tuple[str, ...], uses: tuple[str, ...] = ()
) -> str | None:
    """What differs in `cls.name` from the coroutine method a fix expects, or None.

    `uses`: names hypercorn's own code refers to that the fix relies on (or mimics). A method
    already patched is checked through its `__wrapped__` chain, i.e. hypercorn's own."""
    method = getattr(cls, name, None)
    if method is None:
        return f"{cls.__name__}.{name} is gone"
    method = inspect.unwrap(method)
    if not inspect.iscoroutinefunction(method):
        return f"{cls.__name__}.{name} is no longer a coroutine function"
    found = tuple(inspect.signature(method).parameters)
    if found != params:
        return f"{cls.__name__}.{name} takes {found}, not {params}"
    missing = sorted(set(uses) - _names(method.__code__))
    if missing:
        return f"{cls.__name__}.{name} no longer uses {', '.join(missing)}"
    return None


def attributes_problem(cls: type, attributes: tuple[str, ...]) -> str | None:
    """Instance attributes a fix reads that `cls.__init__` no longer sets, or None."""
    missing = sorted(set(attributes) - _names(inspect.unwrap(cast(Any, cls).__init__).__code__))
    if missing:
        return f"{cls.__name__}.__init__ no longer sets {', '.join(missing)}"
    return None


def first(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


def is_property(cls: type, name: str) -> str | None:
    if isinstance(inspect.getattr_static(cls, name, None), property):
        return None
    return f"{cls.__name__}.{name} is no longer a property"


def has(owner: Any, *names: str) -> str | None:
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        return f"{getattr(owner, '__name__', owner)} has no {', '.join(missing)}"
    return None


@dataclass(frozen=True)
class Patch:
    """`cls.name` replaced by `make(the method it replaces)`."""

    cls: type
    name: str
    make: Callable[[Any], Any]


@dataclass(frozen=True)
class Fix:
    number: int
    title: str
    shape: Callable[[], str | None]  # None: hypercorn has the shape this fix was written for
    patches: Callable[[], tuple[Patch, ...]]
    requires: tuple[int, ...] = ()  # fixes whose patches this one wraps

    def install(self) -> None:
        for patch in self.patches():
            original = getattr(patch.cls, patch.name, None)
            replacement = patch.make(original)
            if original is not None:
                functools.update_wrapper(replacement, original)  # __wrapped__: the shape check
            setattr(patch.cls, patch.name, replacement)
