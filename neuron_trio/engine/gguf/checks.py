"""Limits on what a GGUF file may ask of the reader, checked before anything is allocated.

A model file is untrusted input (a runtime load may name any file under `model_dirs`). Every
count in a GGUF header is a 64-bit number the reader would otherwise believe: a 4 KB file
claiming 3,000,000 blocks made the reader build 27 million tensor names (2.2 GB), a 3,000-deep
array of arrays overflowed the stack, and zero heads divided by zero. So, before the reader
allocates for a count, the count is checked against the bytes left in the file (every item
takes at least a few bytes) and against a cap; the numbers that shape the model are checked
before any arithmetic uses them. A failed check is `ModelFileError` naming the problem (the
HTTP layer answers 422, a default model exits 69).

Kept apart from `gguf_file.py`'s config reading on purpose: that reader grows with each model
family, these limits do not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuron_trio.errors import ModelFileError

# The header (metadata and tensor table) of the largest vocabularies we know (Gemma 3's 262k
# tokens with scores and types; Llama 3's 280k merges) is 10-20 MB; 256 MB leaves room.
MAX_HEADER_BYTES = 256 << 20
MAX_ARRAY_LENGTH = 1 << 24  # elements in one metadata array (vocabularies are ~10^5)
MAX_ARRAY_DEPTH = 2  # arrays of arrays; no known model nests deeper
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 16
# One vocabulary token's bytes. Real vocabularies stay under 200 (SmolLM2: 162, Gemma 3: 48);
# llguidance's token trie panics past 1024, and SentencePiece merges are derived in time
# quadratic in a token's length (a 1,000,000-character token: ~100 s).
MAX_TOKEN_BYTES = 1024

# The fewest bytes each item can take in the file: a key/value pair (8-byte key length, a
# 1-byte key, 4-byte type, a 1-byte value) and a tensor entry (8-byte name length, 1-byte
# name, 4-byte dim count, one 8-byte dim, 4-byte type, 8-byte offset).
MIN_KV_BYTES = 8 + 1 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8
# The fewest bytes of one array element, by GGUF value type (strings: their 8-byte length;
# arrays: 4-byte type + 8-byte count).
_STRING, _ARRAY = 8, 9
_ELEMENT_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_ELEMENT_BYTES |= {_STRING: 8, _ARRAY: 12}

# Model-shaping metadata ("{arch}.<suffix>"): each must be a positive integer no larger than
# this (per-layer lists: each element). Larger than any real model by far, small enough that
# products of them stay exact and allocations stay bounded by the tensor checks.
SHAPE_KEY_CAPS = {
    "block_count": 1 << 12,
    "embedding_length": 1 << 17,
    "feed_forward_length": 1 << 20,
    "attention.head_count": 1 << 12,
    "attention.head_count_kv": 1 << 12,
    "attention.key_length": 1 << 13,
    "attention.value_length": 1 << 13,
    "rope.dimension_count": 1 << 13,
    "context_length": 1 << 24,
    "vocab_size": 1 << 22,
}
# ... and no smaller than this: a model must hold at least one KV block's worth of tokens (a
# context of 1 left the warm-up no room for a prompt and its token: a 500, not a 422).
SHAPE_KEY_FLOORS = {"context_length": 16}
# Floats that must be finite and positive.
POSITIVE_FLOAT_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")


def _fail(path: Path | str, detail: str) -> ModelFileError:
    return ModelFileError(f"{path}: {detail}")


def check_header_counts(path: Path, n_tensors: int, n_kv: int, pos: int, file_size: int) -> None:
    """The header's tensor and key/value counts fit in the bytes after `pos`."""
    left = file_size - pos
    need = n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES
    if need > left:
        raise _fail(
            path,
            f"the header claims {n_kv} metadata keys and {n_tensors} tensors, which cannot fit "
            f"in the {left} bytes left in the file",
        )


def check_header_size(path: Path, pos: int) -> None:
    if pos > MAX_HEADER_BYTES:
        raise _fail(path, f"the GGUF header is larger than {MAX_HEADER_BYTES} bytes")


def check_array(
    path: Path, sub_type: int, count: int, depth: int, pos: int, file_size: int
) -> None:
    """An array of `count` elements of `sub_type` at nesting `depth` (1: a top-level array)."""
    if depth > MAX_ARRAY_DEPTH:
        raise _fail(path, f"metadata arrays nested deeper than {MAX_ARRAY_DEPTH} at byte {pos}")
    if count > MAX_ARRAY_LENGTH:
        raise _fail(
            path, f"a metadata array of {count} elements (at most {MAX_ARRAY_LENGTH}) at byte {pos}"
        )
    size = _ELEMENT_BYTES.get(sub_type)
    if size is None:
        raise _fail(path, f"unknown GGUF array element type {sub_type} at byte {pos}")
    if count * size > file_size - pos:
        raise _fail(
            path,
            f"a metadata array of {count} elements at byte {pos} runs past the end of the file",
        )


def check_tensor_info(path: Path, name: str, dims: list[int], seen: Mapping[str, Any]) -> None:
    if name in seen:
        raise _fail(path, f"tensor {name} is listed twice")
    if not 1 <= len(dims) <= MAX_TENSOR_DIMS:
        raise _fail(path, f"tensor {name} has {len(dims)} dimensions (1 to {MAX_TENSOR_DIMS})")
    if any(d < 1 for d in dims) or math.prod(dims) >= 1 << 48:
        raise _fail(path, f"tensor {name} has an impossible shape {dims}")


def check_tensor_dims_count(path: Path, name: str, n_dims: int) -> None:
    if not 1 <= n_dims <= MAX_TENSOR_DIMS:
        raise _fail(path, f"tensor {name} has {n_dims} dimensions (1 to {MAX_TENSOR_DIMS})")


def check_alignment(path: Path, align: Any) -> int:
    if (
        not isinstance(align, int)
        or isinstance(align, bool)
        or not 1 <= align <= MAX_ALIGNMENT
        or align & (align - 1)
    ):
        raise _fail(
            path, f"general.alignment {align!r} is not a power of two up to {MAX_ALIGNMENT}"
        )
    return align


def check_shape_metadata(path: Path, metadata: Mapping[str, Any], n_tensors: int) -> None:
    """The architecture's shape numbers are positive, bounded, and `block_count` fits the
    tensor table (each block holds at least one tensor) before anything is built from them."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return  # reported by the config reader (missing or unsupported architecture)
    for suffix, cap in SHAPE_KEY_CAPS.items():
        key = f"{arch}.{suffix}"
        if key not in metadata:
            continue
        value = metadata[key]
        values = value if isinstance(value, list) else [value]
        floor = SHAPE_KEY_FLOORS.get(suffix, 1)
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool) or not floor <= v <= cap:
                raise _fail(
                    path,
                    f"metadata {key} = {_short(value)} is not an integer from {floor} to {cap}",
                )
    blocks = metadata.get(f"{arch}.block_count")
    if isinstance(blocks, int) and blocks > n_tensors:
        raise _fail(
            path, f"metadata {arch}.block_count = {blocks} but the file holds {n_tensors} tensors"
        )
    for suffix in POSITIVE_FLOAT_KEYS:
        key = f"{arch}.{suffix}"
        value = metadata.get(key)
        if value is None:
            continue
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise _fail(path, f"metadata {key} = {_short(value)} is not a finite positive number")


def check_llama_shapes(path: Path, config: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The shared tensors of the Llama-like families have the shapes `config` says.

    A mismatch would otherwise surface as a torch error deep in loading (a 500). Only tensors
    present are checked (a missing one is reported by the config reader), and only the names
    every supported family uses in the same layout.
    """
    dim, hd = config.dim, config.head_dim
    q_rows, kv_rows = config.n_heads * hd, config.n_kv_heads * hd
    if config.n_heads % config.n_kv_heads:
        return  # reported by the config reader
    expected: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (config.vocab_size, dim),
        "output.weight": (config.vocab_size, dim),
        "output_norm.weight": (dim,),
    }
    per_block = {
        "attn_norm.weight": (dim,),
        "attn_q.weight": (q_rows, dim),
        "attn_k.weight": (kv_rows, dim),
        "attn_v.weight": (kv_rows, dim),
        "attn_output.weight": (dim, q_rows),
        "ffn_gate.weight": (config.ffn_dim, dim),
        "ffn_down.weight": (dim, config.ffn_dim),
    }
    if "blk.0.ffn_gate.weight" in shapes:  # phi3 fuses gate and up into one ffn_up
        per_block["ffn_up.weight"] = (config.ffn_dim, dim)
    for i in range(config.n_layers):
        for part, shape in per_block.items():
            expected[f"blk.{i}.{part}"] = shape
    for name, shape in expected.items():
        found = shapes.get(name)
        if found is not None and tuple(found) != shape:
            raise _fail(
                path,
                f"tensor {name} has shape {list(found)} but the metadata implies {list(shape)}",
            )


def check_vocabulary(path: Path, metadata: Mapping[str, Any], embedding_rows: int | None) -> None:
    """The tokenizer's vocabulary is one the tokenizer builders and the model can take: every
    token a non-empty string of at most MAX_TOKEN_BYTES, no string twice, no more tokens than
    the embedding has rows (a token id past them would index outside it mid-request), and every
    merge `"left right"` joins two tokens into a third.

    Linear in the vocabulary's bytes. Before these checks, an empty or repeated token string
    and a merge of two control tokens made the tokenizer library fail (a 500) or panic (the
    process exited 1), and a token over 1024 bytes panicked the grammar engine's token trie.
    """
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return  # a file without a tokenizer: reported when one is built
    if not isinstance(tokens, list):
        raise _fail(path, "tokenizer.ggml.tokens is not an array")
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise _fail(path, f"token {i} of tokenizer.ggml.tokens is not a string")
        if not token:
            raise _fail(path, f"token {i} of tokenizer.ggml.tokens is an empty string")
        if len(token) > MAX_TOKEN_BYTES or len(token.encode("utf-8")) > MAX_TOKEN_BYTES:
            raise _fail(
                path,
                f"token {i} of tokenizer.ggml.tokens is {len(token.encode('utf-8'))} bytes long "
                f"(at most {MAX_TOKEN_BYTES})",
            )
        first = seen.setdefault(token, i)
        if first != i:
            raise _fail(
                path, f"tokens {first} and {i} of tokenizer.ggml.tokens are both {_short(token)}"
            )
    if embedding_rows is not None and len(tokens) > embedding_rows:
        raise _fail(
            path,
            f"the tokenizer has {len(tokens)} tokens but token_embd.weight only {embedding_rows} "
            "rows",
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        return
    if not isinstance(merges, list):
        raise _fail(path, "tokenizer.ggml.merges is not an array")
    spelled = _bpe_spellings(metadata, tokens)
    for i, merge in enumerate(merges):
        if not isinstance(merge, str):
            raise _fail(path, f"merge {i} of tokenizer.ggml.merges is not a string")
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise _fail(path, f"merge {i} of tokenizer.ggml.merges, {_short(merge)}, is not 'A B'")
        for part in (left, right, left + right):
            if part not in spelled:
                raise _fail(
                    path,
                    f"merge {i} of tokenizer.ggml.merges, {_short(merge)}, names "
                    f"{_short(part)}, which is not a token",
                )


def _bpe_spellings(metadata: Mapping[str, Any], tokens: list[str]) -> set[str]:
    """The strings merges are written in: the tokens themselves, and for byte-level BPE
    (`gpt2`) also a raw-text token spelled in GPT-2's byte alphabet, as the tokenizer keys it."""
    spelled = set(tokens)
    if metadata.get("tokenizer.ggml.model") == "gpt2":
        alphabet = gpt2_byte_alphabet()
        letters = set(alphabet)
        for token in tokens:
            if not set(token) <= letters:
                spelled.add("".join(alphabet[b] for b in token.encode("utf-8")))
    return spelled


def gpt2_byte_alphabet() -> list[str]:
    """GPT-2's byte alphabet: the printable character that spells each byte in a vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
