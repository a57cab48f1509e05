"""The typed description of a model, read from GGUF metadata (gpt-fast's `ModelArgs`, in spirit).

One decoder-only transformer covers Llama and its relatives; each field below is a way in
which a family departs from Llama 2, so the model (`engine.model.transformer`) branches on a field, never
on a family's name. `engine.gguf.families` fills it in from a file's metadata and tensor names.

| field | families |
| --- | --- |
| `qkv_bias` | qwen2 (biases on Q, K and V) |
| `qk_norm` | qwen3, gemma3 (RMSNorm over each head of Q and K before RoPE) |
| `post_norms` | gemma2, gemma3 (RMSNorm of the attention and FFN outputs before the residual add) |
| `embed_scale` | gemma (token embeddings times sqrt(width)) |
| `activation` | "gelu_tanh" for gemma, else "silu" |
| `attn_scale` | gemma (1 / sqrt(query_pre_attn_scalar)); 0 means 1 / sqrt(head_dim) |
| `attn_softcap`, `final_softcap` | gemma2 (tanh soft-capping of attention scores and logits) |
| `sliding_window`, `sliding_layers` | gemma2 (every other layer), gemma3 (5 of every 6) |
| `rope_base_local` | gemma3 (its sliding layers rotate with base 10000) |
| `rope_freq_factors`, `rope_scale` | llama 3.x (`rope_freqs` tensor), linear scaling |

Gemma's `(1 + w)` RMSNorm needs no field: llama.cpp's converter stores `1 + w` in the file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_base: float
    rope_dim: int
    rms_eps: float
    context_length: int  # what the model was trained for (GGUF llama.context_length)
    tied_output: bool  # no output.weight: the token embedding is the output head
    arch: str = "llama"  # general.architecture, for messages
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: float = 1.0
    activation: str = "silu"  # "silu" | "gelu_tanh", applied to the gate
    attn_scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    attn_softcap: float = 0.0  # 0: none
    final_softcap: float = 0.0  # 0: none
    sliding_window: int = 0  # 0: none; else a sliding layer's query sees its last W positions
    sliding_layers: tuple[bool, ...] = ()  # per layer; empty: no sliding layer
    rope_base_local: float = 0.0  # sliding layers' RoPE base; 0: rope_base
    rope_freq_factors: tuple[
        float, ...
    ] = ()  # per frequency, divides it (Llama 3.x); global layers
    rope_scale: float = 1.0  # linear RoPE scaling (positions / scale); global layers only

    def is_sliding(self, layer: int) -> bool:
        return (
            bool(self.sliding_window) and bool(self.sliding_layers) and self.sliding_layers[layer]
        )

    @property
    def has_local_rope(self) -> bool:
        """Whether sliding layers rotate with other tables than global ones (gemma3)."""
        return any(self.sliding_layers) and (
            (self.rope_base_local not in (0.0, self.rope_base))
            or bool(self.rope_freq_factors)
            or self.rope_scale != 1.0
        )

    def shard(self, tp: int) -> LlamaConfig:
        """The per-rank shape under `tp`-way tensor parallelism (heads, KV heads, FFN split).

        When `tp` exceeds the KV heads (a multiple of them), each rank holds one KV head, a
        copy of the one its query heads use. The caller has already checked divisibility
        (see executor.tp.sharding.check_tp).
        """
        return replace(
            self,
            n_heads=self.n_heads // tp,
            n_kv_heads=max(1, self.n_kv_heads // tp),
            ffn_dim=self.ffn_dim // tp,
        )
