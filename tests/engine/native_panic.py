"""A real Rust panic through pyo3, for tests of its translation (any helper may import this).

pyo3's `PanicException` cannot be imported (pyo3 makes the class at run time), so it is caught
once from llguidance's token trie, which panics on a token longer than 1024 bytes (the
tokenizer is built from metadata, so gguf_checks' limit on token length is not in the way).
"""

from __future__ import annotations

import llguidance

from neuron_trio.engine.text.structured.grammar import _Wrapper
from neuron_trio.engine.text.tokenizer import Tokenizer
from tests.engine.tiny_gguf import tiny_vocab


def long_token_tokenizer(length: int = 1025) -> Tokenizer:
    """The tiny vocabulary plus one normal token of `length` bytes."""
    tokens, types, merges = tiny_vocab()
    return Tokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": [*tokens, "a" * length],
            "tokenizer.ggml.token_type": [*types, 1],
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": 2,
        }
    )


def make_panic() -> BaseException:
    """A PanicException raised by llguidance (its message: an assertion in its token trie)."""
    tokenizer = long_token_tokenizer()
    wrapper = llguidance.TokenizerWrapper(_Wrapper(tokenizer, len(tokenizer.tokens)))
    try:
        llguidance.LLTokenizer(wrapper, n_vocab=len(tokenizer.tokens), eos_token=[2])
    except BaseException as exc:
        if isinstance(exc, Exception):
            raise
        return exc
    raise AssertionError("llguidance no longer panics on a 1025-byte token")
