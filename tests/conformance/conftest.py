"""The conformance suite's daemon: one real `neuron serve` on the built-in model per test
module (started once, shared by the module's tests), and the built-in model's tokenizer for
tests that need token ids (what llama.cpp's tests get from its `/tokenize`).

Every test here is slow (a real daemon); requests keep `max_tokens` small so that the whole
suite stays within a few minutes on two cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from neuron_trio.engine.gguf.builtin import builtin_model_path
from tests.neuron_process import builtin_daemon, skip_without_builtin_model

MODEL = "smollm2-135m"
CONTEXT = 1024  # small: the "prompt too long" cases need few tokens to exceed it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/conformance/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def neuron_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`http://127.0.0.1:PORT` of a daemon serving the built-in model as `smollm2-135m`."""
    skip_without_builtin_model()
    tmp = tmp_path_factory.mktemp("conformance")
    with builtin_daemon(tmp, context=CONTEXT, tp={"probe_interval_s": 3600}) as (url, _):
        yield url


@pytest.fixture(scope="module")
def api_base(neuron_url: str) -> str:
    return f"{neuron_url}/v1"


@pytest.fixture(scope="module")
def http(neuron_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=neuron_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenize() -> object:
    """The built-in model's prompt tokenizer, as the engine applies it (BOS when wanted)."""
    from neuron_trio.engine.gguf.file import GGUFFile
    from neuron_trio.engine.text.tokenizer import Tokenizer

    with GGUFFile(builtin_model_path()) as gf:
        tok = Tokenizer.from_metadata(gf.metadata)

    def encode(text: str) -> list[int]:
        ids = tok.encode(text, add_special_tokens=False)
        if tok.add_bos and tok.bos_id is not None:
            ids.insert(0, tok.bos_id)
        return ids

    return encode


def sse_chunks(raw: str) -> list[dict[str, object]]:
    """The JSON `data:` payloads of a chat/completions SSE body, without `[DONE]`."""
    import json

    out = []
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line.removeprefix("data: ")))
    return out


def log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]
