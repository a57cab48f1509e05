"""The binding's constants agree with the wheel's `nccl.h` (no GPU).

ABI mode never reads the header, so a wrong enum value (a bfloat16 all-reduce summed as
another type) would only show on a GPU. These tests read
`nvidia/nccl/include/nccl.h` from the wheel and compare.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from neuron_trio.executor.tp import nccl_lib


def _header() -> str | None:
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "include" / "nccl.h"
        if path.is_file():
            return path.read_text()
    return None


HEADER = _header()
pytestmark = pytest.mark.skipif(HEADER is None, reason="needs the nvidia-nccl wheel's nccl.h")


def _enum(name: str) -> int:
    assert HEADER is not None
    match = re.search(rf"\b{name}\s*=\s*(\d+)", HEADER)
    assert match, f"{name} not in nccl.h"
    return int(match[1])


@pytest.mark.parametrize(
    ("torch_name", "nccl_name"),
    [
        ("int8", "ncclInt8"),
        ("uint8", "ncclUint8"),
        ("int32", "ncclInt32"),
        ("int64", "ncclInt64"),
        ("float16", "ncclFloat16"),
        ("float32", "ncclFloat32"),
        ("float64", "ncclFloat64"),
        ("bfloat16", "ncclBfloat16"),
    ],
)
def test_datatype_values(torch_name: str, nccl_name: str) -> None:
    assert nccl_lib.DTYPES[torch_name] == _enum(nccl_name)


def test_result_and_op_constants() -> None:
    assert _enum("ncclSum") == nccl_lib.SUM
    assert _enum("ncclSuccess") == nccl_lib.SUCCESS
