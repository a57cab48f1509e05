"""The committed cffi module is exactly what ffi/nccl_build.py generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_committed_module_matches_the_builder(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("nccl_build", ROOT / "ffi" / "nccl_build.py")
    assert spec and spec.loader
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    fresh = builder.generate(tmp_path / "_nccl_cffi.py").read_text()
    committed = (ROOT / "neuron_trio" / "executor" / "tp" / "_nccl_cffi.py").read_text()
    assert fresh == committed, "regenerate it: python ffi/nccl_build.py"
