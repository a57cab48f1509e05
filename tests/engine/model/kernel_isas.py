"""The native kernel's instruction sets this CPU can run, for tests that compare them: each
path must give the same bits (see engine/model/_cpu_kernel.c)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from neuron_trio.engine.model.load import packing

KERNEL = packing.native_kernel()
# "avx2-int8": AVX2 without its int16 paths (each pass as int8 dots), kept to hold them to its bits
ALL_ISAS = ("avx512vnni", "avx2", "avx2-int8")


def usable_isas(kernel: Any = KERNEL) -> list[str]:
    """The names `kernel.use` accepts here, best first (the default is left as it was)."""
    if kernel is None:
        return []
    default = kernel.isa()
    try:
        return [name for name in ALL_ISAS if kernel.use(name)]
    finally:
        kernel.use(default)


def isa_fixture(request: pytest.FixtureRequest) -> Iterator[str]:
    """Body of a fixture parametrised over ALL_ISAS: the kernel switched to one of them (a
    skip where this CPU cannot run it), switched back afterwards."""
    if request.param not in usable_isas():
        pytest.skip(f"{request.param} is not available here")
    assert KERNEL is not None
    default = KERNEL.isa()
    assert KERNEL.use(request.param)
    yield request.param
    KERNEL.use(default)
