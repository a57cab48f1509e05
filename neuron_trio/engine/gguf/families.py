"""GGUF metadata and tensor names → `LlamaConfig`, for each architecture neuron runs.

The keys and tensor names are the ones llama.cpp's converter (`convert_hf_to_gguf.py`) writes
and llama.cpp reads (`llama-model.cpp`); where the file is silent, the constants are
llama.cpp's (e.g. gemma3's sliding pattern and local RoPE base).

| architecture | departs from llama by |
| --- | --- |
| `llama` (also Mistral, Llama 3.x) | Q/K stored permuted; Llama 3.x: `rope_freqs` tensor |
| `qwen2` | Q/K/V biases; Q/K not permuted (NEOX RoPE, as every family below) |
| `qwen3` | QK-norm; `head_dim` from `attention.key_length` |
| `gemma2` | GELU-tanh, embeddings × sqrt(width), post-norms, soft-capping, sliding layers |
| `gemma3` | as gemma2 without soft-capping, plus QK-norm and a local RoPE base |
| `phi3` | fused `attn_qkv` and fused gate/up in `ffn_up` |
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")

# Architectures whose Q and K projections llama.cpp's converter stores permuted for its
# "normal" RoPE (adjacent pairs); the others use NEOX RoPE (two halves) and are stored as is.
PERMUTED_QK = frozenset({"llama"})

_GEMMA = ("gemma2", "gemma3")
# llama.cpp: every 2nd (gemma2) / 6th (gemma3) layer is global, the others slide.
_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# llama.cpp: gemma 27B scales queries by 1 / sqrt(width / heads), the others by 1 / sqrt(head_dim)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

TensorReader = Callable[[str], list[float]]


def config_from_metadata(
    md: Mapping[str, Any],
    tensors: Mapping[str, tuple[int, ...]],
    read_vector: TensorReader,
    where: str,
) -> LlamaConfig:
    """The model's description. `tensors` maps names to shapes (torch order); `read_vector`
    returns a small 1-D tensor's values (rope_freqs). UnsupportedModelError names what is not
    supported, prefixed by `where` (the file)."""
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{where}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"{where}: metadata {arch}.{name} is missing")
        if isinstance(value, list):
            raise UnsupportedModelError(f"{where}: per-layer {arch}.{name} is not supported")
        return value

    if "token_embd.weight" not in tensors:
        raise UnsupportedModelError(f"{where}: tensor token_embd.weight is missing")
    n_layers = int(key("block_count"))
    dim, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", dim // n_heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(
            f"{where}: key length {head_dim} != value length "
            f"{md.get(f'{arch}.attention.value_length')} is not supported"
        )
    vocab = md.get(f"{arch}.vocab_size") or tensors["token_embd.weight"][0]
    gemma = arch in _GEMMA
    fields: dict[str, Any] = dict(
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(key("feed_forward_length")),
        vocab_size=int(vocab),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_dim=int(key("rope.dimension_count", head_dim)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6 if gemma else 1e-5)),
        context_length=int(key("context_length", 2048)),
        tied_output="output.weight" not in tensors,
        arch=arch,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        post_norms="blk.0.post_attention_norm.weight" in tensors,
    )
    fields |= _rope_scaling(arch, md, tensors, read_vector, where, head_dim)
    if gemma:
        fields["embed_scale"] = math.sqrt(dim)
        fields["activation"] = "gelu_tanh"
        big = n_layers == _GEMMA_27B_LAYERS[arch]
        fields["attn_scale"] = 1.0 / math.sqrt(dim / n_heads if big else head_dim)
        fields["attn_softcap"] = float(md.get(f"{arch}.attn_logit_softcapping") or 0.0)
        fields["final_softcap"] = float(md.get(f"{arch}.final_logit_softcapping") or 0.0)
    if arch == "gemma3":
        fields["rope_base_local"] = _GEMMA3_LOCAL_ROPE_BASE
    window = int(md.get(f"{arch}.attention.sliding_window") or 0)
    if window:
        fields["sliding_window"] = window
        fields["sliding_layers"] = _sliding_layers(arch, md, n_layers, where)
    config = LlamaConfig(**fields)
    _check(config, tensors, where)
    return config


def _rope_scaling(
    arch: str,
    md: Mapping[str, Any],
    tensors: Mapping[str, tuple[int, ...]],
    read_vector: TensorReader,
    where: str,
    head_dim: int,
) -> dict[str, Any]:
    """RoPE scaling: Llama 3.x's per-frequency factors (the `rope_freqs` tensor, which
    llama.cpp's converter computes from rope_scaling "llama3"), or linear scaling."""
    out: dict[str, Any] = {}
    kind = md.get(f"{arch}.rope.scaling.type", "none") or "none"
    if kind == "linear":
        factor = float(md.get(f"{arch}.rope.scaling.factor") or 1.0)
        if factor <= 0:
            raise UnsupportedModelError(f"{where}: RoPE scaling factor {factor} is not positive")
        out["rope_scale"] = factor
    elif kind != "none":
        raise UnsupportedModelError(f"{where}: RoPE scaling {kind!r} is not supported")
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name in tensors:
            raise UnsupportedModelError(
                f"{where}: LongRoPE ({name.split('.')[0]}) is not supported"
            )
    if "rope_freqs.weight" in tensors:
        factors = tuple(float(v) for v in read_vector("rope_freqs.weight"))
        if len(factors) != head_dim // 2:
            raise UnsupportedModelError(
                f"{where}: rope_freqs has {len(factors)} factors for head_dim {head_dim}"
            )
        out["rope_freq_factors"] = factors
    return out


def _sliding_layers(
    arch: str, md: Mapping[str, Any], n_layers: int, where: str
) -> tuple[bool, ...]:
    """Which layers slide: the file's `attention.sliding_window_pattern` when it has one
    (a list of booleans, or a period whose last layer is global), else llama.cpp's constants."""
    pattern = md.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise UnsupportedModelError(
                f"{where}: sliding_window_pattern has {len(pattern)} entries for {n_layers} layers"
            )
        return tuple(bool(p) for p in pattern)
    period = int(pattern) if pattern else _SLIDING_PERIOD.get(arch, 1)
    if period <= 1:  # every layer slides (e.g. a Mistral-style window)
        return (True,) * n_layers
    return tuple((i + 1) % period != 0 for i in range(n_layers))


def _check(config: LlamaConfig, tensors: Mapping[str, tuple[int, ...]], where: str) -> None:
    if config.rope_dim != config.head_dim:
        raise UnsupportedModelError(
            f"{where}: partial RoPE ({config.rope_dim} of {config.head_dim} dims) is not supported"
        )
    if config.n_heads % config.n_kv_heads:
        raise UnsupportedModelError(
            f"{where}: {config.n_heads} heads are not a multiple of {config.n_kv_heads} KV heads"
        )
    missing = [n for n in expected_tensor_names(config, tensors) if n not in tensors]
    if missing:
        raise UnsupportedModelError(f"{where}: tensor {missing[0]} is missing")


def expected_tensor_names(
    config: LlamaConfig, tensors: Mapping[str, Any] | None = None
) -> list[str]:
    """Every tensor a GGUF file must hold for `config` (phi3's fused ones when `tensors` has
    them)."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not config.tied_output:
        names.append("output.weight")
    tensors = tensors or {}
    fused_qkv = "blk.0.attn_qkv.weight" in tensors
    fused_ffn = "blk.0.ffn_gate.weight" not in tensors and config.arch == "phi3"
    for i in range(config.n_layers):
        parts = ["attn_norm", "attn_output", "ffn_norm", "ffn_up", "ffn_down"]
        parts += ["attn_qkv"] if fused_qkv else ["attn_q", "attn_k", "attn_v"]
        if not fused_ffn:
            parts.append("ffn_gate")
        if config.qk_norm:
            parts += ["attn_q_norm", "attn_k_norm"]
        if config.post_norms:
            parts += ["post_attention_norm", "post_ffw_norm"]
        names += [f"blk.{i}.{part}.weight" for part in parts]
        if config.qkv_bias:
            names += [f"blk.{i}.attn_{p}.bias" for p in "qkv"]
    return names
