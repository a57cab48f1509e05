"""The shape of a Llama-architecture model, read from GGUF metadata."""

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

    def shard(self, tp: int) -> LlamaConfig:
        """The per-rank shape under `tp`-way tensor parallelism (heads, KV heads, FFN split).

        The caller has already checked divisibility (see parallel.sharding.check_tp).
        """
        return replace(
            self,
            n_heads=self.n_heads // tp,
            n_kv_heads=self.n_kv_heads // tp,
            ffn_dim=self.ffn_dim // tp,
        )
