"""The Llama transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or separate head.

Built on the meta device by `engine.loader`, which then assigns every weight (fused QKV and
fused gate/up projections, dense or weight-only int4/int8). The forward pass is a generator,
`Transformer.forward_steps`: a tensor-parallel shard (`partial_sums=True`) yields the partial
output of each row-parallel projection (attention output, MLP down) and continues with the
all-reduced sum sent back; an unsharded model never yields. So the model never imports a
communicator (see docs/ARCHITECTURE.md).

Shapes: B rows, T new tokens per row, H query heads, KV key/value heads, D head_dim,
L attended positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F
from torch import nn

from neuron_trio.engine.kv_cache import KVCache
from neuron_trio.engine.llama_config import LlamaConfig

META = torch.device("meta")


class Linear(nn.Module):
    """y = x · Wᵀ with a dense weight `[out, in]` (float32, bfloat16 or float16)."""

    weight: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


# At or above this many rows (prefill chunks), the int kernels lose to a dense GEMM: layers
# that keep a dense copy use it (measured on 2 CPU cores: int4 at 256 rows ~4x slower).
DENSE_MIN_ROWS = 16


class Int4Linear(nn.Module):
    """Weight-only int4 (groups of `group` inputs) through torch's CPU kernel; bf16 in and out.

    With `dense` (a bfloat16 copy of the weight), inputs of DENSE_MIN_ROWS rows or more take a
    dense GEMM instead.
    """

    dense: torch.Tensor | None

    def __init__(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        out_f: int,
        in_f: int,
        group: int,
        dense: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)  # [in/group, out, 2]
        self.register_buffer("dense", dense)
        self.out_features, self.in_features, self.group = out_f, in_f, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.numel() >= DENSE_MIN_ROWS * self.in_features:
            return F.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features), self.packed, self.group, self.scales_zeros
        )
        return y.reshape(*lead, self.out_features)


class Int8Linear(nn.Module):
    """Weight-only int8 (one scale per output row) through torch's CPU kernel; bf16 in.

    With `dense`, inputs of DENSE_MIN_ROWS rows or more take a dense GEMM in its dtype.
    """

    dense: torch.Tensor | None

    def __init__(
        self, weight: torch.Tensor, scales: torch.Tensor, dense: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # int8 [out, in]
        self.register_buffer("scales", scales)  # [out]
        self.register_buffer("dense", dense)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.numel() >= DENSE_MIN_ROWS * self.in_features:
            return F.linear(x.to(self.dense.dtype), self.dense)
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, self.in_features), self.weight, self.scales
        )
        return y.reshape(*lead, self.out_features)


def _meta_linear(out_f: int, in_f: int) -> Linear:
    return Linear(torch.empty(out_f, in_f, device=META))


class Block(nn.Module):
    """One transformer layer. Its projections are assigned by the loader."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.dim, self.eps = c.dim, c.rms_eps
        self.register_buffer("attn_norm", torch.empty(c.dim, device=META))
        self.register_buffer("ffn_norm", torch.empty(c.dim, device=META))
        qkv_out = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.wqkv: nn.Module = _meta_linear(qkv_out, c.dim)
        self.wo: nn.Module = _meta_linear(c.dim, c.n_heads * c.head_dim)
        self.w_gate_up: nn.Module = _meta_linear(2 * c.ffn_dim, c.dim)
        self.w_down: nn.Module = _meta_linear(c.dim, c.ffn_dim)

    def steps(
        self,
        x: torch.Tensor,  # [B, T, dim] residual stream
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin: [B, T, 1, D]
        k_cache: torch.Tensor,  # [slots, KV, context, D]
        v_cache: torch.Tensor,
        write: tuple[int, int, int] | tuple[torch.Tensor, torch.Tensor],
        read: int | torch.Tensor | slice,
        length: int,
        mask: torch.Tensor | None,
        causal: bool,
        act: torch.dtype,
        partial: bool,
    ) -> Generator[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        h, kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        hn = F.rms_norm(x, (self.dim,), self.attn_norm, self.eps).to(act)
        qkv = self.wqkv(hn)  # [B, T, (H + 2KV) · D]
        # RoPE on Q and K together: rotate the halves of each head (un-permuted layout).
        qk = qkv[..., : (h + kv) * d].reshape(b, t, h + kv, d)
        cos, sin = rope
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
        q = qk[:, :, :h].transpose(1, 2)  # [B, H, T, D]
        k = qk[:, :, h:].transpose(1, 2)  # [B, KV, T, D]
        v = qkv[..., (h + kv) * d :].reshape(b, t, kv, d).transpose(1, 2)  # [B, KV, T, D]
        if len(write) == 3:  # one row: slot, first position, count
            slot, p0, n = write
            k_cache[slot, :, p0 : p0 + n] = k[0]
            v_cache[slot, :, p0 : p0 + n] = v[0]
        else:  # decode rows: one position each
            slots_t, pos_t = write
            k_cache[slots_t, :, pos_t] = k[:, :, 0]
            v_cache[slots_t, :, pos_t] = v[:, :, 0]
        keys = k_cache[read, :, :length]  # [B, KV, L, D]
        values = v_cache[read, :, :length]
        if keys.dim() == 3:
            keys, values = keys.unsqueeze(0), values.unsqueeze(0)
        if keys.dtype != q.dtype:  # a KV cache kept in another dtype than the activations
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if t == 1:
            # Decode: the H / KV query heads of a group attend to the same keys, so they can
            # stand in for query positions ([B, KV, H/KV, D]); no K/V expansion, and the
            # per-row mask [B, 1, 1, L] still broadcasts.
            o = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv, d), keys, values, mask)
        else:
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=kv != h
            )  # [B, H, T, D]
        o = self.wo(o.transpose(1, 2).reshape(b, t, h * d) if t > 1 else o.reshape(b, 1, h * d))
        if partial:
            o = yield o
        x = x + o
        hn = F.rms_norm(x, (self.dim,), self.ffn_norm, self.eps).to(act)
        gate, up = self.w_gate_up(hn).chunk(2, dim=-1)  # [B, T, ffn] each
        y = self.w_down(F.silu(gate) * up)  # [B, T, dim]
        if partial:
            y = yield y
        return x + y


class Transformer(nn.Module):
    """A Llama model (or one tensor-parallel shard of it: `config` is then the shard's shape).

    Dtypes: `act_dtype` is what the projections and attention compute in (and the KV cache's
    default); the residual stream is float32 unless `residual_dtype` says otherwise.
    Call `forward_steps` under `torch.inference_mode()` (SingleRunner does).
    """

    tok_embeddings: torch.Tensor
    norm: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(
        self,
        config: LlamaConfig,
        *,
        partial_sums: bool = False,
        act_dtype: torch.dtype = torch.float32,
        residual_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.partial_sums = partial_sums
        self.act_dtype = act_dtype
        self.residual_dtype = residual_dtype
        self.scheme = "float32"  # how the loader stored the weights (loader.resolve_dtype)
        self.register_buffer(
            "tok_embeddings", torch.empty(config.vocab_size, config.dim, device=META)
        )
        self.register_buffer("norm", torch.empty(config.dim, device=META))
        self.output: nn.Module = _meta_linear(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.register_buffer("rope_cos", torch.empty(0, config.head_dim, device=META))
        self.register_buffer("rope_sin", torch.empty(0, config.head_dim, device=META))

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.device

    def init_rope(self, positions: int) -> None:
        """Precompute RoPE tables for positions 0..positions-1 on the model's device.

        cos is `[P, D]` (each frequency twice); sin carries the sign of rotate-half,
        (-sin, +sin), so that RoPE(x) = x·cos + roll(x, D/2)·sin.
        """
        c = self.config
        if self.rope_cos.device == self.device and self.rope_cos.shape[0] >= positions:
            return
        half = c.head_dim // 2
        inv = 1.0 / (c.rope_base ** (torch.arange(half, dtype=torch.float64) / half))
        ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]  # [P, D/2]
        cos, sin = ang.cos(), ang.sin()
        self.rope_cos = torch.cat((cos, cos), dim=-1).to(self.act_dtype).to(self.device)
        self.rope_sin = torch.cat((-sin, sin), dim=-1).to(self.act_dtype).to(self.device)

    def forward_steps(
        self,
        input_ids: torch.Tensor,  # [B, T] int64; B > 1 only with T == 1
        start_pos: torch.Tensor,  # [B] int64: position of input_ids[:, 0] in each row's slot
        slots: torch.Tensor,  # [B] int64: KV cache row of each sequence
        kv: KVCache,
        *,
        all_logits: bool = False,
    ) -> Generator[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the model over the rows, writing their K/V; return float32 logits.

        Returns `[B, V]` (each row's last position) or `[B, T, V]` with `all_logits`. A
        prefill chunk is one row (B == 1, T >= 1) continuing its slot from `start_pos`;
        decode rows (T == 1) may have different lengths: each attends to its own prefix.
        With `partial_sums`, yields each row-parallel partial output `[B, T, dim]` and
        continues with the tensor sent back.
        """
        b, t = input_ids.shape
        if b > 1 and t != 1:
            raise ValueError(f"a batch of {b} rows must be decode rows (T == 1), got T == {t}")
        starts = start_pos.tolist()
        ends = [s + t for s in starts]
        length = max(ends)
        if length > kv.context:
            raise ValueError(f"position {length - 1} is past the KV cache's context {kv.context}")
        self.init_rope(length)
        positions = start_pos.to(self.device)[:, None] + torch.arange(t, device=self.device)
        rope = (self.rope_cos[positions][:, :, None], self.rope_sin[positions][:, :, None])
        mask: torch.Tensor | None = None
        causal = False
        write: tuple[int, int, int] | tuple[torch.Tensor, torch.Tensor]
        read: int | torch.Tensor | slice
        if b == 1:
            slot = int(slots[0])
            write, read = (slot, starts[0], t), slot
            if t > 1 and starts[0] == 0:
                causal = True
            elif t > 1:  # a chunk after a cached prefix: query i sees keys 0..start+i
                cols = torch.arange(length, device=self.device)
                mask = (cols[None, :] <= positions[0][:, None])[None, None]  # [1, 1, T, L]
        else:
            slot_list = slots.tolist()
            slots_dev = slots.to(self.device)
            write = (slots_dev, start_pos.to(self.device))
            first = slot_list[0]
            if slot_list == list(range(first, first + b)):
                read = slice(first, first + b)  # a view, no gather
            else:
                read = slots_dev
            if min(ends) != length:
                cols = torch.arange(length, device=self.device)
                ends_t = torch.tensor(ends, device=self.device)
                mask = (cols[None, :] < ends_t[:, None])[:, None, None]  # [B, 1, 1, L]
        x = F.embedding(input_ids.to(self.device), self.tok_embeddings).to(self.residual_dtype)
        act, partial = self.act_dtype, self.partial_sums
        for i, layer in enumerate(self.layers):
            x = yield from layer.steps(  # type: ignore[operator]
                x, rope, kv.k[i], kv.v[i], write, read, length, mask, causal, act, partial
            )
        if not all_logits:
            x = x[:, -1]  # [B, dim]
        x = F.rms_norm(x, (self.config.dim,), self.norm, self.config.rms_eps).to(act)
        return self.output(x).float()


def run_to_end(
    steps: Generator[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Drive a `forward_steps` generator that never yields (an unsharded model)."""
    try:
        partial = next(steps)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    steps.close()
    raise RuntimeError(f"an unsharded model yielded a partial sum {tuple(partial.shape)}")
