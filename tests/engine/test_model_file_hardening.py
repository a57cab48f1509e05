"""Model files that made the node exit 1 or answer 500: each is now a ModelFileError naming the
problem (422 at run time, exit 69 for a default model), found cheaply.

Issue 25, findings 2 (a native panic while loading), 8 (quadratic merge derivation) and the
files-and-tokens part of 10. Files are written by tests/engine/tiny_gguf.py (real tokenizers)
and tests/engine/hostile_gguf.py (byte by byte).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tests.engine.tiny_gguf as tiny
from neuron_trio.engine.engine import Engine
from neuron_trio.engine.gguf.checks import MAX_TOKEN_BYTES
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.text.native_errors import is_native_panic, panics_as_model_file_errors
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.types import Constraint
from neuron_trio.engine.warm_up import warm_up
from neuron_trio.errors import ApiError, ModelFileError
from tests.engine.hostile_gguf import kv, kv_str, kv_u32, llama_kvs, llama_tensors, raw_gguf
from tests.engine.native_panic import long_token_tokenizer, make_panic
from tests.engine.tiny_gguf import write_with_vocab, write_with_weights


def refused(path: Path, match: str) -> str:
    """Loading `path` fails with ModelFileError matching `match`, before any weight is read
    (the header checks: GGUFFile alone refuses it)."""
    with pytest.raises(ModelFileError, match=match) as info:
        GGUFFile(path)
    with pytest.raises(ModelFileError, match=match):
        Engine.from_gguf(path, max_batch=2, context=64)
    return str(info.value)


# ---- finding 2: a native panic while loading ---------------------------------------------------


def test_a_merge_of_two_control_tokens_is_refused_not_a_panic(tmp_path: Path) -> None:
    path = write_with_vocab(
        tmp_path / "merge.gguf", lambda t, y, m: m.append("<|endoftext|> <|endoftext|>")
    )
    message = refused(path, "merge 29 of tokenizer.ggml.merges")
    assert "'<|endoftext|><|endoftext|>', which is not a token" in message


def test_the_tokenizer_library_panic_itself_becomes_a_model_file_error() -> None:
    # Past the header checks (metadata given directly), the tokenizers library panics on this
    # merge: the tokenizer's edge translates it (before: PanicException, a BaseException).
    tokens, types, merges = tiny.tiny_vocab()
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [*merges, "<|endoftext|> <|endoftext|>"],
    }
    with pytest.raises(ModelFileError, match="the tokenizer"):
        Tokenizer.from_metadata(metadata)


def test_a_token_longer_than_1024_bytes_is_refused_at_the_header(tmp_path: Path) -> None:
    long = "a" * (MAX_TOKEN_BYTES + 1)
    path = write_with_vocab(tmp_path / "long.gguf", lambda t, y, m: (t.append(long), y.append(1)))
    assert "1025 bytes long (at most 1024)" in refused(path, "token 288 of tokenizer.ggml.tokens")
    # ... and one of exactly 1024 bytes is a model (llguidance's trie takes it)
    ok = "b" * MAX_TOKEN_BYTES
    path = write_with_vocab(tmp_path / "ok.gguf", lambda t, y, m: (t.append(ok), y.append(1)))
    GGUFFile(path).close()


def test_a_grammar_engine_panic_fails_structured_output_only(tmp_path: Path) -> None:
    # llguidance's tokenizer panics on a 1025-byte token (the header checks refuse such a file;
    # this vocabulary is built from metadata). It is built by the first constrained request,
    # not the warm-up: the model warms up and serves plain chats, and a JSON request gets a
    # 500 that says structured output is unavailable (its panic caught, never a BaseException
    # that ends the process), again at once for the next one.
    engine = Engine.from_gguf(tiny.write_tiny_llama(tmp_path / "m.gguf"), max_batch=2, context=64)
    engine.tokenizer = long_token_tokenizer()
    engine.vocab_size = len(engine.tokenizer.tokens)
    warm_up(engine)
    json = Constraint(kind="json", schema='{"type":"object"}')
    for _ in range(2):
        with pytest.raises(ApiError, match="structured output is not available") as info:
            engine.compile_constraint(json)
        assert info.value.status == 500 and info.value.code == "grammar_unavailable"
    with pytest.raises(ValueError, match="structured output is not available"):
        engine.grammar.compile_lark('start: "x"')  # an auto tool call's rest: unconstrained


def test_panics_are_recognised_and_only_panics_translated() -> None:
    panic = make_panic()
    assert not isinstance(panic, Exception) and is_native_panic(panic)
    assert not is_native_panic(KeyboardInterrupt()) and not is_native_panic(ValueError())
    with (
        pytest.raises(ModelFileError, match="loading x: a native library panicked on this file"),
        panics_as_model_file_errors("loading x"),
    ):
        raise panic
    with pytest.raises(KeyboardInterrupt), panics_as_model_file_errors("loading x"):
        raise KeyboardInterrupt


# ---- finding 8: a token's length made the merge derivation quadratic ---------------------------


def sentencepiece_metadata(extra_token: str) -> dict[str, Any]:
    pieces = ["<unk>", "<s>", "</s>", *"abcdefgh", "ab", extra_token]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * (len(pieces) - 3),
        "tokenizer.ggml.scores": [0.0] * len(pieces),
    }


def test_deriving_merges_is_bounded_before_the_work_starts() -> None:
    # 12,000 characters: 1.44e8 character operations, over the bound (about 18 s of work
    # before the bound; 1,000,000 characters took ~100 s).
    with pytest.raises(ModelFileError, match="too long"):
        Tokenizer.from_metadata(sentencepiece_metadata("ab" * 6_000))
    # an ordinary vocabulary still gets its merges
    tokenizer = Tokenizer.from_metadata(sentencepiece_metadata("abc"))
    assert tokenizer.encode("abc", add_special_tokens=False) == [tokenizer.token_to_id("abc")]


def test_a_million_character_sentencepiece_token_is_refused_at_the_header(tmp_path: Path) -> None:
    metadata = sentencepiece_metadata("x" * 1_000_000)
    kvs = [
        *llama_kvs(),
        kv_str("tokenizer.ggml.model", "llama"),
        kv(
            "tokenizer.ggml.tokens",
            9,
            _string_array(metadata["tokenizer.ggml.tokens"]),
        ),
    ]
    path = raw_gguf(tmp_path / "spm.gguf", kvs, llama_tensors(vocab=16))
    with pytest.raises(ModelFileError, match=r"token 12 of tokenizer\.ggml\.tokens is 1000000"):
        GGUFFile(path)


def _string_array(values: list[str]) -> bytes:
    import struct

    from tests.engine.hostile_gguf import T_STRING, enc_string

    return struct.pack("<IQ", T_STRING, len(values)) + b"".join(enc_string(v) for v in values)


# ---- finding 10: bad files that gave a 500 ----------------------------------------------------


def test_an_ffn_up_of_the_wrong_shape_is_refused_at_the_header(tmp_path: Path) -> None:
    def narrow(w: dict[str, np.ndarray]) -> None:
        w["blk.0.ffn_up.weight"] = np.ascontiguousarray(w["blk.0.ffn_up.weight"][:, :32])

    path = write_with_weights(tmp_path / "ffn.gguf", narrow)
    refused(path, r"tensor blk.0.ffn_up.weight has shape \[128, 32\] but the metadata implies")


def test_fewer_embedding_rows_than_tokens_is_refused(tmp_path: Path) -> None:
    # no vocab_size key: the model's vocabulary is the embedding's 16 rows, the tokenizer's 20
    tokens = [f"t{i}" for i in range(20)]
    kvs = [
        *llama_kvs(),
        kv_str("tokenizer.ggml.model", "gpt2"),
        kv("tokenizer.ggml.tokens", 9, _string_array(tokens)),
    ]
    path = raw_gguf(tmp_path / "rows.gguf", kvs, llama_tensors(vocab=16))
    with pytest.raises(ModelFileError, match=r"20 tokens but token_embd\.weight only 16 rows"):
        GGUFFile(path)


def test_a_context_length_of_one_is_refused(tmp_path: Path) -> None:
    path = tiny.write_tiny_llama(tmp_path / "ctx.gguf", context_length=1)
    refused(path, "llama.context_length = 1 is not an integer from 16")
    kvs = [*llama_kvs(), kv_u32("llama.context_length", 16)]
    GGUFFile(raw_gguf(tmp_path / "ok.gguf", kvs, llama_tensors())).close()


def test_empty_and_repeated_token_strings_are_refused(tmp_path: Path) -> None:
    def empty(t: list[str], y: list[int], m: list[str]) -> None:
        t.append("")
        y.append(1)

    def repeated(t: list[str], y: list[int], m: list[str]) -> None:
        t.append(t[200])
        y.append(1)

    refused(write_with_vocab(tmp_path / "e.gguf", empty), "token 288 .* is an empty string")
    refused(write_with_vocab(tmp_path / "r.gguf", repeated), "tokens 200 and 288 .* are both")
