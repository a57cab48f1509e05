"""Sharding rules and per-rank shapes, on the built-in model's shape (9 heads / 3 KV heads)."""

from __future__ import annotations

import pytest
import torch

from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.errors import ConfigError
from neuron_trio.executor.tp.sharding import check_tp, rank_shapes, shard_fn

SMOLLM2 = LlamaConfig(
    n_layers=30,
    dim=576,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    ffn_dim=1536,
    vocab_size=49152,
    rope_base=100000.0,
    rope_dim=64,
    rms_eps=1e-5,
    context_length=8192,
    tied_output=True,
)
C = SMOLLM2


def _full() -> dict[str, torch.Tensor]:
    q, kv = C.n_heads * C.head_dim, C.n_kv_heads * C.head_dim
    return {
        "token_embd.weight": torch.randn(C.vocab_size, C.dim),
        "output_norm.weight": torch.randn(C.dim),
        "blk.0.attn_norm.weight": torch.randn(C.dim),
        "blk.0.ffn_norm.weight": torch.randn(C.dim),
        "blk.0.attn_q.weight": torch.randn(q, C.dim),
        "blk.0.attn_q.bias": torch.randn(q),
        "blk.0.attn_k.weight": torch.randn(kv, C.dim),
        "blk.0.attn_v.weight": torch.randn(kv, C.dim),
        "blk.0.attn_output.weight": torch.randn(C.dim, q),
        "blk.0.ffn_gate.weight": torch.randn(C.ffn_dim, C.dim),
        "blk.0.ffn_up.weight": torch.randn(C.ffn_dim, C.dim),
        "blk.0.ffn_down.weight": torch.randn(C.dim, C.ffn_dim),
        "blk.0.ffn_down.bias": torch.randn(C.dim),
    }


def test_tp3_gives_every_rank_3_heads_and_1_kv_head() -> None:
    assert rank_shapes(C, 3) == [{"heads": 3, "kv_heads": 1}] * 3
    assert rank_shapes(C, 1) == [{"heads": 9, "kv_heads": 3}]


def test_check_tp_names_both_numbers() -> None:
    check_tp(C, 1)
    check_tp(C, 3)
    with pytest.raises(ConfigError, match=r"tp = 2 does not divide 9 attention heads / 3 KV heads"):
        check_tp(C, 2)
    with pytest.raises(ConfigError):
        check_tp(C, 9)  # 9 heads but 3 KV heads
    with pytest.raises(ConfigError):
        check_tp(C, 0)


def test_shard_shapes_of_every_rank() -> None:
    full = _full()
    hd = C.head_dim
    expected = {
        "token_embd.weight": (C.vocab_size, C.dim),
        "output_norm.weight": (C.dim,),
        "blk.0.attn_norm.weight": (C.dim,),
        "blk.0.ffn_norm.weight": (C.dim,),
        "blk.0.attn_q.weight": (3 * hd, C.dim),
        "blk.0.attn_q.bias": (3 * hd,),
        "blk.0.attn_k.weight": (hd, C.dim),
        "blk.0.attn_v.weight": (hd, C.dim),
        "blk.0.attn_output.weight": (C.dim, 3 * hd),
        "blk.0.ffn_gate.weight": (512, C.dim),
        "blk.0.ffn_up.weight": (512, C.dim),
        "blk.0.ffn_down.weight": (C.dim, 512),
        "blk.0.ffn_down.bias": (C.dim,),
    }
    shards = [{n: shard_fn(C, r, 3)(n, t) for n, t in full.items()} for r in range(3)]
    for rank_shards in shards:
        assert {n: tuple(t.shape) for n, t in rank_shards.items()} == expected
        assert all(t.is_contiguous() for t in rank_shards.values())
    # Column shards concatenate back along rows, row shards along columns.
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_up.weight"):
        assert torch.equal(torch.cat([s[name] for s in shards], 0), full[name])
    for name in ("blk.0.attn_output.weight", "blk.0.ffn_down.weight"):
        assert torch.equal(torch.cat([s[name] for s in shards], 1), full[name])
    # Replicated tensors are untouched; a row-parallel bias is added once (rank 0).
    assert torch.equal(shards[2]["token_embd.weight"], full["token_embd.weight"])
    bias = torch.stack([s["blk.0.ffn_down.bias"] for s in shards]).sum(0)
    assert torch.equal(bias, full["blk.0.ffn_down.bias"])


def test_row_parallel_matmul_sums_to_the_full_product() -> None:
    full = _full()
    x = torch.randn(2, C.ffn_dim)
    w = full["blk.0.ffn_down.weight"]
    parts = []
    for r in range(3):
        shard = shard_fn(C, r, 3)
        w_r = shard("blk.0.ffn_down.weight", w)
        parts.append(x[:, r * 512 : (r + 1) * 512] @ w_r.T)
    torch.testing.assert_close(torch.stack(parts).sum(0), x @ w.T, rtol=1e-4, atol=1e-4)


def test_tp1_is_the_identity() -> None:
    t = torch.randn(4, 4)
    assert shard_fn(C, 0, 1)("blk.0.attn_q.weight", t) is t
