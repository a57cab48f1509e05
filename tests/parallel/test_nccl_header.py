"""The binding's constants and `ncclConfig_t` prefix agree with the wheel's `nccl.h` (no GPU).

ABI mode never reads the header, so a wrong enum value (a bfloat16 all-reduce summed as
another type) or a misplaced config field would only show on a GPU. These tests read
`nvidia/nccl/include/nccl.h` from the wheel and compare.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from neuron_trio.parallel import nccl_lib
from neuron_trio.parallel._nccl_cffi import ffi


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


def _define(name: str) -> int:
    assert HEADER is not None
    match = re.search(rf"#define\s+{name}\s+(0x[0-9a-fA-F]+|\d+)", HEADER)
    assert match, f"{name} not in nccl.h"
    return int(match[1], 0)


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


def test_result_op_and_config_constants() -> None:
    assert _enum("ncclSum") == nccl_lib.SUM
    assert _enum("ncclSuccess") == nccl_lib.SUCCESS
    assert _enum("ncclInProgress") == nccl_lib.IN_PROGRESS
    assert _define("NCCL_API_MAGIC") == nccl_lib.CONFIG_MAGIC
    assert _define("NCCL_UNIQUE_ID_BYTES") == ffi.sizeof("ncclUniqueId")


def test_config_prefix_layout() -> None:
    """`{size_t size; unsigned magic; unsigned version; int blocking; int cgaClusterSize; …}`.

    The declared prefix is padded to 24 bytes, so NCCL's copy of `size` bytes also takes the
    padding (zero) as `cgaClusterSize`; NCCL resets that field to its default for a config
    `version` below 2.17, which is why CONFIG_VERSION stays in [2.14, 2.17).
    """
    assert HEADER is not None
    body = re.search(r"typedef struct ncclConfig_v\d+ \{(.*?)\} ncclConfig_t;", HEADER, re.S)
    assert body, "ncclConfig_t not in nccl.h"
    fields = re.findall(r"^\s*([\w ]+?)\s+\**(\w+);", body[1], re.M)
    assert fields[:5] == [
        ("size_t", "size"),
        ("unsigned int", "magic"),
        ("unsigned int", "version"),
        ("int", "blocking"),
        ("int", "cgaClusterSize"),
    ]
    assert [ffi.offsetof("ncclConfig_t", f) for f in ("size", "magic", "version", "blocking")] == [
        0,
        8,
        12,
        16,
    ]
    assert ffi.sizeof("ncclConfig_t") == 24
    assert 21400 <= nccl_lib.CONFIG_VERSION < 21700
