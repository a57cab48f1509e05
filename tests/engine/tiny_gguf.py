"""Write tiny random Llama GGUF files for fast tests (any helper may import this).

`write_tiny_llama(path, **shape)` writes, with the `gguf` package's writer, a file laid out
like the built-in model: llama metadata, random weights (Q/K stored permuted as llama.cpp's
converter does), and a real tokenizer: a byte-level BPE vocabulary (3 control tokens, the
256 byte symbols of GPT-2's byte encoder, and merged tokens), merges, token types, BOS/EOS
ids and a ChatML chat template. Deterministic for a given seed. `write_with_vocab` and
`write_with_weights` write one whose vocabulary or weights a test has edited.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# Control tokens first, as in SmolLM2: <|endoftext|>=0, <|im_start|>=1 (BOS), <|im_end|>=2 (EOS).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 1, 2, 0, 2
# Merges in rank order; each merged token is appended to the vocabulary in this order.
MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "s"),
    ("r", "e"),
    ("a", "t"),
    ("Ġ", "w"),
    ("o", "r"),
    ("e", "n"),
    ("i", "s"),
    ("Ġ", "i"),
    ("l", "l"),
    ("Ġ", "c"),
    ("Ġ", "b"),
    ("Ġ", "f"),
    ("e", "s"),
    ("Ġ", "o"),
    ("Ġ", "p"),
    ("a", "n"),
    ("Ġ", "m"),
    ("Ġa", "n"),
    ("Ġan", "d"),
    ("Ġ", "h"),
    ("o", "u"),
    ("Ġ", "d"),
]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's byte encoder: the printable symbol for each byte value 0..255, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny byte-level BPE tokenizer."""
    tokens = [*SPECIAL_TOKENS, *byte_symbols(), *(a + b for a, b in MERGES)]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))  # 3 control
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def tiny_weights(
    *,
    n_layers: int,
    dim: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    tied: bool,
    seed: int,
) -> dict[str, np.ndarray]:
    """Random float32 weights in the LOGICAL layout (Q/K not permuted), torch order [out, in]."""
    rng = np.random.default_rng(seed)
    head_dim = dim // n_heads

    def mat(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((vocab_size, dim)).astype(np.float32),
        "output_norm.weight": norm(dim),
    }
    if not tied:
        w["output.weight"] = mat(vocab_size, dim)
    for i in range(n_layers):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = norm(dim)
        w[p + "attn_q.weight"] = mat(n_heads * head_dim, dim)
        w[p + "attn_k.weight"] = mat(n_kv_heads * head_dim, dim)
        w[p + "attn_v.weight"] = mat(n_kv_heads * head_dim, dim)
        w[p + "attn_output.weight"] = mat(dim, n_heads * head_dim)
        w[p + "ffn_norm.weight"] = norm(dim)
        w[p + "ffn_gate.weight"] = mat(ffn_dim, dim)
        w[p + "ffn_up.weight"] = mat(ffn_dim, dim)
        w[p + "ffn_down.weight"] = mat(dim, ffn_dim)
    return w


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K permutation: per head, two halves → interleaved pairs."""
    out_f, in_f = w.shape
    hd = out_f // n_heads
    return np.ascontiguousarray(
        w.reshape(n_heads, 2, hd // 2, in_f).swapaxes(1, 2).reshape(out_f, in_f)
    )


def write_tiny_llama(
    path: str | Path,
    *,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn_dim: int = 128,
    context_length: int = 256,
    rope_base: float = 10000.0,
    rms_eps: float = 1e-5,
    tied: bool = True,
    qtype: str = "F32",
    seed: int = 0,
    chat_template: str | None = CHATML_TEMPLATE,
    extra_metadata: dict[str, Any] | None = None,
    overrides: dict[str, str] | None = None,
    arch: str = "llama",
    raw_blocks: dict[str, tuple[str, np.ndarray]] | None = None,
    edit_vocab: Callable[[list[str], list[int], list[str]], None] | None = None,
    edit_weights: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> Path:
    """Write a tiny random llama GGUF file at `path` and return the path.

    `qtype` is the format of the 2-D weights: "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1" or "Q5_0"
    (block formats need `dim` and `ffn_dim` to be multiples of 32); norms stay F32 and the
    embedding is Q8_0 when `qtype` is a block format (as in the built-in model). The
    vocabulary has `len(tiny_vocab()[0])` tokens. `extra_metadata` adds string/int/float keys;
    `overrides` maps tensor names to another format (any that `gguf.quants.quantize` writes);
    `arch` other than "llama" writes an unsupported architecture (for error tests).
    `raw_blocks` maps tensor names to (format, uint8 blocks `[rows, bytes per row]`), written
    as they are (for formats the `gguf` package cannot quantise, e.g. IQ4_NL or Q3_K).
    `edit_vocab(tokens, types, merges)` and `edit_weights(weights)` change the lists and the
    weights in place before they are written (hostile files: a bad merge, a wrong shape).
    """
    path = Path(path)
    tokens, token_types, merges = (list(x) for x in tiny_vocab())
    if edit_vocab is not None:
        edit_vocab(tokens, token_types, merges)
    weights = tiny_weights(
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        vocab_size=len(tokens),
        tied=tied,
        seed=seed,
    )
    if edit_weights is not None:
        edit_weights(weights)
    qt = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_block_count(n_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn_dim)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(rms_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(dim // n_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, float(value))
    block_formats = {"Q8_0", "Q4_0", "Q4_1", "Q5_0"}
    for name, w in weights.items():
        if name.endswith("attn_q.weight"):
            w = _permute(w, n_heads)
        elif name.endswith("attn_k.weight"):
            w = _permute(w, n_kv_heads)
        if w.ndim == 1:
            writer.add_tensor(name, w)
            continue
        if raw_blocks and name in raw_blocks:
            fmt, blocks = raw_blocks[name]
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[fmt])
            continue
        t = qt
        if name == "token_embd.weight" and qtype in block_formats:
            t = gguf.GGMLQuantizationType.Q8_0
        if overrides and name in overrides:
            t = gguf.GGMLQuantizationType[overrides[name]]
        if t == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        elif t == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            data = gguf.quants.quantize(w, t)
            writer.add_tensor(name, data, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_with_vocab(
    path: Path, edit: Callable[[list[str], list[int], list[str]], None], **kw: Any
) -> Path:
    """A tiny llama whose vocabulary (tokens, types, merges) `edit` changes in place."""
    return write_tiny_llama(path, edit_vocab=edit, **kw)


def write_with_weights(path: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> Path:
    return write_tiny_llama(path, edit_weights=edit)
