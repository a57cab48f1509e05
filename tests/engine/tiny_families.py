"""Tiny random GGUF files of each model family, as llama.cpp's converter lays them out.

`write_tiny_family(path, family)` writes, with the `gguf` package's writer, random float32
weights under the tensor names and metadata keys that `convert_hf_to_gguf.py` writes for that
family, and a small real tokenizer of the family's kind: byte-level BPE with the family's
pre-tokenizer name (qwen2, llama-bpe), or a SentencePiece-style vocabulary (`llama` model:
scores, byte fallback tokens, add_bos, add_space_prefix) for mistral, gemma and phi3.

Shapes follow what transformers assumes when it reads a GGUF file, so that it is a reference:
gemma's head_dim is 256 (transformers keeps query_pre_attn_scalar = 256), qwen3's is 128
(transformers does not read qwen3's key_length and defaults to 128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.engine.tiny_gguf import CHATML_TEMPLATE, MERGES, byte_symbols

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] "
    "| trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] "
    "+ '<|end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% else %}{{ eos_token }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] "
    "+ '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Words whose pieces make the SentencePiece vocabulary (every prefix of "▁word" and of "word").
_SPM_WORDS = ["the", "and", "is", "capital", "of", "France", "Paris", "hello", "world", "a", "in"]


@dataclass(frozen=True)
class Family:
    arch: str
    name: str
    tokenizer: str  # "bpe" | "spm"
    pre: str = ""  # byte-level BPE pre-tokenizer name
    specials: tuple[str, ...] = ()
    bos: int = 1
    eos: int = 2
    add_bos: bool = False
    add_space_prefix: bool = True
    template: str = CHATML_TEMPLATE
    shape: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # metadata keys after "{arch}."


FAMILIES: dict[str, Family] = {
    "llama3": Family(
        "llama",
        "tiny-llama-3.1",
        "bpe",
        pre="llama-bpe",
        specials=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|eot_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
        ),
        bos=0,
        eos=1,
        add_bos=True,
        template=LLAMA3_TEMPLATE,
        shape=dict(rope_base=10000.0, llama3_rope=True),
    ),
    "mistral": Family(
        "llama",
        # llama.cpp writes Mistral as a llama file; transformers 5 cannot read one named
        # exactly "mistral" (its gguf lookup has no such architecture), so the name differs
        "tiny-mistral-7b-v0.3",
        "spm",
        specials=("<unk>", "<s>", "</s>"),
        add_bos=True,
        template=MISTRAL_TEMPLATE,
    ),
    "qwen2": Family(
        "qwen2",
        "tiny-qwen2.5",
        "bpe",
        pre="qwen2",
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=0,
        eos=2,
        shape=dict(rope_base=1000000.0),
    ),
    "qwen3": Family(
        "qwen3",
        "tiny-qwen3",
        "bpe",
        pre="qwen2",
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=0,
        eos=2,
        shape=dict(head_dim=128, rope_base=1000000.0),
    ),
    "gemma2": Family(
        "gemma2",
        "tiny-gemma-2",
        "spm",
        specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        bos=2,
        eos=1,
        add_bos=True,
        add_space_prefix=False,
        template=GEMMA_TEMPLATE,
        shape=dict(head_dim=256, n_layers=4),
        extra={
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "attention.sliding_window": 8,
        },
    ),
    "gemma3": Family(
        "gemma3",
        "tiny-gemma-3",
        "spm",
        specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        bos=2,
        eos=1,
        add_bos=True,
        add_space_prefix=False,
        template=GEMMA_TEMPLATE,
        shape=dict(head_dim=256, n_layers=7, rope_base=1000000.0),
        extra={"attention.sliding_window": 8},
    ),
    "phi3": Family(
        "phi3",
        "tiny-phi-3",
        "spm",
        specials=("<unk>", "<s>", "</s>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"),
        eos=2,  # </s>; <|end|> ends a turn (chat.END_OF_TURN_TOKENS)
        template=PHI3_TEMPLATE,
    ),
}


def spm_vocab(specials: tuple[str, ...]) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: control tokens (<unk> is UNKNOWN), the 256 byte
    fallback tokens, then pieces with scores that fall with their position (so merging by
    score and merging by position, as transformers does for gemma, agree)."""
    tokens: list[str] = []
    types: list[int] = []
    for s in specials:
        tokens.append(s)
        types.append(2 if s == "<unk>" else 3)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)
    pieces: list[str] = ["\u2581"]
    for word in _SPM_WORDS:
        for form in ("\u2581" + word, word):
            for i in range(1, len(form) + 1):
                if form[:i] not in pieces:
                    pieces.append(form[:i])
    # every single character first (merges need both halves in the vocabulary)
    singles = sorted({c for p in pieces for c in p} - set(pieces))
    pieces = singles + pieces
    pieces.sort(key=len)
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def bpe_vocab(specials: tuple[str, ...]) -> tuple[list[str], list[int], list[str]]:
    tokens = [*specials, *byte_symbols(), *(a + b for a, b in MERGES)]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def llama3_rope_factors(
    head_dim: int, base: float, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """`rope_freqs` as llama.cpp's converter computes it from rope_scaling "llama3"."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original=64)


def write_tiny_family(
    path: str | Path,
    family: str,
    *,
    seed: int = 0,
    qtype: str = "F32",
    qtypes: dict[str, str] | None = None,
) -> Path:
    """Write a tiny random GGUF file of `family` (a key of FAMILIES) and return its path.
    `qtypes`: another format for the matrices whose names end so (as real files mix Q4_K
    with Q6_K or Q8_0: {"attn_v.weight": "Q8_0"})."""
    fam = FAMILIES[family]
    shape: dict[str, Any] = dict(
        n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, rope_base=10000.0
    )
    shape.update(fam.shape)
    n_layers, dim, n_heads, n_kv = (shape[k] for k in ("n_layers", "dim", "n_heads", "n_kv_heads"))
    head_dim = shape.get("head_dim", dim // n_heads)
    ffn = shape["ffn_dim"]
    rng = np.random.default_rng(seed)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), fam.arch)
    writer.add_name(fam.name)
    writer.add_block_count(n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(shape["rope_base"])
    writer.add_layer_norm_rms_eps(1e-6 if fam.arch.startswith("gemma") else 1e-5)
    if head_dim != dim // n_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if fam.arch not in ("gemma2", "gemma3", "qwen2", "qwen3"):
        writer.add_rope_dimension_count(head_dim)
    for key, value in fam.extra.items():
        full = f"{fam.arch}.{key}"
        if isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)

    if fam.tokenizer == "bpe":
        tokens, types, merges = bpe_vocab(fam.specials)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(fam.pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    else:
        tokens, scores, types = spm_vocab(fam.specials)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(fam.add_space_prefix)
        writer.add_unk_token_id(fam.specials.index("<unk>"))
    writer.add_bos_token_id(fam.bos)
    writer.add_eos_token_id(fam.eos)
    writer.add_pad_token_id(fam.eos)
    writer.add_add_bos_token(fam.add_bos)
    writer.add_chat_template(fam.template)
    vocab = len(tokens)

    def mat(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((vocab, dim)).astype(np.float32)
    }
    if fam.arch.startswith("gemma"):
        w["token_embd.weight"] /= np.sqrt(dim)  # gemma scales it back up by sqrt(dim)
    w["output_norm.weight"] = norm(dim)
    if not fam.arch.startswith("gemma"):
        w["output.weight"] = mat(vocab, dim)
    if shape.get("llama3_rope"):
        s = LLAMA3_SCALING
        w["rope_freqs.weight"] = llama3_rope_factors(
            head_dim, shape["rope_base"], s["factor"], s["low_freq_factor"],
            s["high_freq_factor"], s["original"],
        )  # fmt: skip
    q_out, kv_out = n_heads * head_dim, n_kv * head_dim
    for i in range(n_layers):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = norm(dim)
        if fam.arch == "phi3":
            w[p + "attn_qkv.weight"] = mat(q_out + 2 * kv_out, dim)
        else:
            w[p + "attn_q.weight"] = mat(q_out, dim)
            w[p + "attn_k.weight"] = mat(kv_out, dim)
            w[p + "attn_v.weight"] = mat(kv_out, dim)
        if fam.arch == "qwen2":
            for part, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                w[p + f"attn_{part}.bias"] = (0.5 * rng.standard_normal(n)).astype(np.float32)
        if fam.arch in ("qwen3", "gemma3"):
            w[p + "attn_q_norm.weight"] = norm(head_dim)
            w[p + "attn_k_norm.weight"] = norm(head_dim)
        w[p + "attn_output.weight"] = mat(dim, q_out)
        if fam.arch.startswith("gemma"):
            w[p + "post_attention_norm.weight"] = norm(dim)
            w[p + "post_ffw_norm.weight"] = norm(dim)
        w[p + "ffn_norm.weight"] = norm(dim)
        if fam.arch == "phi3":
            w[p + "ffn_up.weight"] = mat(2 * ffn, dim)  # gate rows, then up rows
        else:
            w[p + "ffn_gate.weight"] = mat(ffn, dim)
            w[p + "ffn_up.weight"] = mat(ffn, dim)
        w[p + "ffn_down.weight"] = mat(dim, ffn)
    for name, t in w.items():
        suffix = next((k for k in qtypes or {} if name.endswith(k)), None)
        qt = gguf.GGMLQuantizationType[qtype if suffix is None else (qtypes or {})[suffix]]
        if t.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, t)
        else:
            writer.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
