"""`system_fingerprint`: which model file and which engine build produced an answer.

OpenAI's clients read `system_fingerprint` to tell whether two answers came from the same
backend configuration (a changed value means a seeded request may answer differently). Here
it is a digest of the model file, the dtype it runs in and the engine build (neuron's
version, torch's), computed once when a model loads.

The file is not hashed whole: an 8B model is ~16 GB, minutes of reading at every load. What
is hashed is its size and its first and last `EDGE_BYTES`: the GGUF header (every metadata
key, the tokenizer, every tensor's name, type, shape and offset) lies at the start, and the
last tensor's bytes at the end, so a re-quantised, re-converted or truncated file changes
the digest, while the same file gives the same digest on every node and every start.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

import neuron_trio

__all__ = ["EDGE_BYTES", "engine_build", "model_fingerprint"]

EDGE_BYTES = 4 << 20  # the header of the built-in model's GGUF is ~1.6 MiB (its vocabulary)


def engine_build() -> str:
    """neuron's version and the torch it computes with (a new torch may change numerics)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    return f"neuron {neuron_trio.__version__}; torch {torch_version}"


def model_fingerprint(path: Path, dtype: str) -> str:
    """`fp_` and 16 hex digits: a digest of the file at `path` (its size, first and last
    `EDGE_BYTES`), the configured `dtype` and `engine_build()`. Reads at most 8 MiB.

    Raises OSError if the file cannot be read.
    """
    digest = hashlib.blake2b(digest_size=8)
    with path.open("rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        digest.update(size.to_bytes(8, "little"))
        digest.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            digest.update(f.read(EDGE_BYTES))
    digest.update(f"\0{dtype}\0{engine_build()}".encode())
    return "fp_" + digest.hexdigest()
