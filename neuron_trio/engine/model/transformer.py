"""The Llama transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or separate head,
and what its relatives add, switched on by `LlamaConfig` (never by a family's name): Q/K/V
biases, QK-norm, post-attention/post-FFN norms, GELU-tanh, scaled embeddings, soft-capped
attention scores and logits, sliding-window layers (a mask over the full KV rows) with their
own RoPE tables, Llama 3.x's per-frequency RoPE factors.

Built on the meta device by `engine.model.loader`, which then assigns every weight (fused QKV and
fused gate/up projections, dense or weight-only int4/int8). The forward pass is a generator,
`Transformer.forward_steps`: a tensor-parallel shard (`partial_sums=True`) yields the partial
output of each row-parallel projection (attention output, MLP down) and continues with the
all-reduced sum sent back; an unsharded model never yields. So the model never imports a
communicator (see docs/ARCHITECTURE.md).

Shapes: B rows, T new tokens per row, H query heads, KV key/value heads, D head_dim,
L attended positions, V vocabulary.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Generator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from neuron_trio.engine.block_pool import BLOCK_TOKENS, NULL_BLOCK, blocks_for
from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.engine.model.kv_cache import KVCache
from neuron_trio.engine.model.linear import Linear

META = torch.device("meta")


def _meta_linear(out_f: int, in_f: int) -> Linear:
    return Linear(torch.empty(out_f, in_f, device=META))


class Block(nn.Module):
    """One transformer layer. Its projections and norms are assigned by the loader.

    Optional parts (None when the family has none, see LlamaConfig): `qkv_bias` `[(H + 2KV)·D]`,
    `qk_norm` `[H + KV, D]` (each Q head's weight, then each K head's), `post_attn_norm` and
    `post_ffn_norm` `[dim]`.
    """

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None
    post_attn_norm: torch.Tensor | None
    post_ffn_norm: torch.Tensor | None

    def __init__(self, config: LlamaConfig, index: int = 0) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.dim, self.eps = c.dim, c.rms_eps
        self.sliding = c.is_sliding(index)
        self.scale = c.attn_scale or None  # None: SDPA's 1 / sqrt(D)
        self.softcap = c.attn_softcap
        self.gelu = c.activation == "gelu_tanh"
        self.register_buffer("attn_norm", torch.empty(c.dim, device=META))
        self.register_buffer("ffn_norm", torch.empty(c.dim, device=META))
        qkv_out = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.register_buffer("qkv_bias", torch.empty(qkv_out, device=META) if c.qkv_bias else None)
        qk_heads = c.n_heads + c.n_kv_heads
        qk_norm = torch.empty(qk_heads, c.head_dim, device=META) if c.qk_norm else None
        self.register_buffer("qk_norm", qk_norm)
        post = torch.empty(c.dim, device=META) if c.post_norms else None
        self.register_buffer("post_attn_norm", post)
        self.register_buffer("post_ffn_norm", None if post is None else torch.empty_like(post))
        self.wqkv: nn.Module = _meta_linear(qkv_out, c.dim)
        self.wo: nn.Module = _meta_linear(c.dim, c.n_heads * c.head_dim)
        self.w_gate_up: nn.Module = _meta_linear(2 * c.ffn_dim, c.dim)
        self.w_down: nn.Module = _meta_linear(c.dim, c.ffn_dim)
        # The native kernel module when decode attention should run in it (the loader sets it
        # under "auto" on CPU; float32, the reference, keeps SDPA).
        self.attend_kernel: Any = None

    def steps(
        self,
        x: torch.Tensor,  # [N, dim] residual stream: B · T rows (row-major), or at.real's
        # cos, signed sin: per row [N, H + 2KV, D], or with at.positions the float32 tables
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,  # this layer's K/V pool: [2KV, pool tokens, D]
        at: _Placement,
        act: torch.dtype,
        partial: bool,
    ) -> Generator[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        n = x.shape[0]
        # Modules and buffers straight from their dicts: nn.Module.__getattr__ costs ~0.5 us a
        # lookup, 6 per layer and step.
        mods, bufs, shape = self._modules, self._buffers, (self.dim,)
        native_rope = at.positions is not None
        # float32 for the native RoPE: Q, K and V are then rounded to `act` once, after it
        # (where the projection's kernel can write float32 directly)
        qkv = mods["wqkv"].normed(  # type: ignore[union-attr,operator]
            x, bufs["attn_norm"], self.eps, act, torch.float32 if native_rope else None
        )
        bias = bufs["qkv_bias"]
        if bias is not None:
            qkv = qkv + bias
        qkv = qkv.view(n, h + 2 * kv, d)
        qk_norm = bufs["qk_norm"]
        if qk_norm is not None:  # RMSNorm over each Q and K head, before RoPE
            qk = F.rms_norm(qkv[:, : h + kv], (d,), eps=self.eps) * qk_norm
            qkv = torch.cat((qk.to(qkv.dtype), qkv[:, h + kv :]), dim=1)
        if native_rope:  # RoPE and the K/V write in one native call
            q = self._rope_write(qkv, rope, cache, at, act)  # [N, H, D]
        else:
            # RoPE on every head at once: the V heads get cos = 1, sin = 0 (rope tables).
            cos, sin = rope
            qkv = torch.addcmul(qkv * cos, qkv.roll(d // 2, dims=-1), sin)
            new_kv = qkv[:, h:]  # [N, 2KV, D]: K heads, then V heads, as the cache keeps them
            # cache: [2KV, pool tokens, D]; indices address its rows flattened, [2KV · pool, D]
            if isinstance(at.write, slice):  # one row on consecutive blocks
                cache[:, at.write] = new_kv.transpose(0, 1)
            else:
                rows = new_kv.transpose(0, 1).reshape(-1, d).to(cache.dtype)  # [2KV · R, D]
                cache.view(-1, d).index_copy_(0, at.write, rows)
            q = qkv[:, :h]
        mask, causal = at.mask, at.causal
        if self.sliding and at.window_mask is not None:  # keys past the window are masked
            mask, causal = at.window_mask, False
        if at.t == 1:
            # Decode: the H / KV query heads of a group attend to the same keys, so they stand
            # in for query positions ([B, KV, H/KV, D]); no K/V expansion, and the per-row
            # mask [B, 1, 1, L] still broadcasts.
            q = q.reshape(n, kv, h // kv, d)
            o = self._attend_decode(q, cache, at, act, mask)
        else:
            keys, values = self._read_kv(cache, at, act)
            if at.real is not None:  # padded chunks: padding queries are zeros, then dropped
                q = q.new_zeros(at.b * at.t, h, d).index_copy_(0, at.real, q)
            q = q.view(at.b, at.t, h, d).transpose(1, 2)  # [B, H, T, D]
            if kv != h and self.softcap:
                keys = keys.repeat_interleave(h // kv, dim=1)
                values = values.repeat_interleave(h // kv, dim=1)
            o = self._attend(q, keys, values, mask, causal)  # [B, H, T, D]
            o = o.transpose(1, 2).reshape(at.b * at.t, h * d)
            if at.real is not None:
                o = o[at.real]
        o = mods["wo"].forward(o)  # type: ignore[union-attr]  # [N, dim]
        if partial:
            o = yield o
        post = bufs["post_attn_norm"]
        if post is not None:  # on the whole sum: after the all-reduce
            o = F.rms_norm(o.to(x.dtype), shape, post, self.eps)
        x = x + o
        # [N, 2 · ffn]
        gate_up = mods["w_gate_up"].normed(x, bufs["ffn_norm"], self.eps, act)  # type: ignore[union-attr,operator]
        y = mods["w_down"].gated(gate_up, self.gelu)  # type: ignore[union-attr,operator]
        if partial:
            y = yield y
        post = bufs["post_ffn_norm"]
        if post is not None:
            y = F.rms_norm(y.to(x.dtype), shape, post, self.eps)
        return x + y

    def _rope_write(
        self,
        qkv: torch.Tensor,  # [N, H + 2KV, D]
        tables: tuple[torch.Tensor, torch.Tensor],  # float32 cos, signed sin: [P, D]
        cache: torch.Tensor,
        at: _Placement,
        act: torch.dtype,
    ) -> torch.Tensor:
        """RoPE on the Q and K heads, K and V into the cache at `at.write_rows`, in the
        native kernel (float32 maths, rounded once); returns Q `[N, H, D]` in `act`."""
        h, d = self.n_heads, self.head_dim
        qkv = qkv.contiguous()
        n = qkv.shape[0]
        q = torch.empty(n, h, d, dtype=act)
        cos, sin = tables
        positions, rows = at.positions, at.write_rows
        assert positions is not None and rows is not None
        bf16 = torch.bfloat16
        flags = int(qkv.dtype == bf16) | 2 * int(cache.dtype == bf16) | 4 * int(act == bf16)
        self.attend_kernel.rope_write(
            qkv.data_ptr(), n, h, self.n_kv_heads, d, flags, positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), cache.data_ptr(), cache.shape[1], rows.data_ptr(),
            q.data_ptr(),
        )  # fmt: skip
        return q

    def _attend_decode(
        self,
        q: torch.Tensor,  # [B, KV, H/KV, D]
        cache: torch.Tensor,
        at: _Placement,
        act: torch.dtype,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Decode attention, `[B, H · D]`: in the native kernel where it fits, else SDPA."""
        kernel, kv = self.attend_kernel, self.n_kv_heads
        if kernel is not None and at.token_rows is not None and cache.dtype == act:
            # Rows on scattered blocks: the kernel reads K/V in place through their token
            # rows (gathering them first cost more than the attention itself at B = 8).
            pool = cache.unsqueeze(0)  # [1, 2KV, pool tokens, D]
            keys, values = pool[:, :kv], pool[:, kv:]
            if _native_attention_fits(q, keys, values, mask, self.softcap):
                rows = at.token_rows
                return _native_attention(kernel, q, keys, values, mask, self.scale, rows=rows)
        keys, values = self._read_kv(cache, at, act)
        if kernel is not None and _native_attention_fits(q, keys, values, mask, self.softcap):
            return _native_attention(kernel, q, keys, values, mask, self.scale)
        return self._attend(q, keys, values, mask, False).reshape(q.shape[0], -1)

    def _read_kv(
        self, cache: torch.Tensor, at: _Placement, act: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys and values, each `[B, KV, L, D]` in `act`: a view of one row on
        consecutive blocks, else one gather (padding positions read the zeroed null block)."""
        kv, d = self.n_kv_heads, self.head_dim
        if isinstance(at.read, slice):
            kv_rows = cache[:, at.read].unsqueeze(0)  # [1, 2KV, L, D]
        else:
            kv_rows = cache.view(-1, d).index_select(0, at.read).view(at.b, 2 * kv, at.length, d)
        if kv_rows.dtype != act:  # a KV cache kept in another dtype than the activations
            kv_rows = kv_rows.to(act)
        return kv_rows[:, :kv], kv_rows[:, kv:]

    def _attend(
        self,
        q: torch.Tensor,  # [B, H, T, D], or decode's [B, KV, H/KV, D]
        keys: torch.Tensor,  # [B, KV, L, D] (or [B, H, L, D] when expanded)
        values: torch.Tensor,
        mask: torch.Tensor | None,  # bool (True = attend) or additive, broadcast to the scores
        causal: bool,
    ) -> torch.Tensor:
        if not self.softcap:
            gqa = q.shape[1] != keys.shape[1]
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa
            )
        # Soft-capped scores (gemma2): cap · tanh(s / cap) before the mask; SDPA cannot.
        scale = self.scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [.., T, L]
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            t, length = scores.shape[-2:]
            mask = torch.ones(t, length, dtype=torch.bool, device=q.device).tril(length - t)
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask
        probs = scores.float().softmax(dim=-1).to(values.dtype)
        return torch.matmul(probs, values)


def _native_attention_fits(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    softcap: float | None,
) -> bool:
    """Whether the native decode attention takes these operands (else SDPA): no soft cap, one
    dtype (bfloat16 or float32) with D contiguous, and no mask or an additive per-row one."""
    dtype = q.dtype
    if softcap or dtype not in (torch.bfloat16, torch.float32):
        return False
    if keys.dtype != dtype or values.dtype != dtype or q.shape[-1] % 8 or q.shape[2] > 16:
        return False
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        return False
    if mask is None:
        return True
    return (
        mask.dtype in (torch.bfloat16, torch.float32)
        and mask.dim() == 4
        and mask.shape[1] == mask.shape[2] == 1
        and mask.stride(-1) == 1
    )


def _native_attention(
    kernel: Any,
    q: torch.Tensor,  # [B, KV, G, D]: one query token per row, G query heads per KV head
    keys: torch.Tensor,  # [B, KV, L, D]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # additive [B or 1, 1, 1, L]
    scale: float | None,
    *,
    rows: torch.Tensor | None = None,  # int64 [B, L]: K/V position l of row b is token row
    # rows[b, l] of keys / values, then [1, KV, pool tokens, D] (the paged pool, in place)
) -> torch.Tensor:
    """Decode attention in the native kernel (float32 maths): `[B, KV · G · D]`."""
    b, kv, groups, d = q.shape
    length = keys.shape[2] if rows is None else rows.shape[1]
    out = torch.empty(b, kv * groups * d, dtype=q.dtype)
    flags = int(q.dtype == torch.bfloat16)
    mask_ptr = mask_stride = 0
    if mask is not None:
        mask_ptr = mask.data_ptr()
        mask_stride = mask.stride(0) if mask.shape[0] > 1 else 0
        flags |= 2 * int(mask.dtype == torch.bfloat16)
    qs, ks, vs = q.stride(), keys.stride(), values.stride()
    kernel.attend(
        q.data_ptr(), qs[0], qs[1], qs[2],
        keys.data_ptr(), ks[0], ks[1], ks[2],
        values.data_ptr(), vs[0], vs[1], vs[2],
        mask_ptr, mask_stride, flags, b, kv, groups, length, d, out.data_ptr(),
        scale or 1.0 / math.sqrt(d), 0 if rows is None else rows.data_ptr(),
    )  # fmt: skip
    return out


class _Placement:
    """Where one forward's rows write and read the KV pool; computed once, used by every layer."""

    __slots__ = (
        "b", "causal", "length", "mask", "positions", "read", "real", "t", "token_rows",
        "window_mask", "write", "write_rows",
    )  # fmt: skip

    def __init__(self) -> None:
        self.b = 1  # rows
        self.t = 1  # tokens per row (padded rows: the longest row's)
        # Where the real tokens' K/V go: a slice of token rows (one row on consecutive
        # blocks) or an index [2KV · R] into the layer's [2KV · pool, D] rows.
        self.write: slice | torch.Tensor = slice(0, 0)
        # The real tokens' token rows in the pool, int64 [R] on the host (the native RoPE's).
        self.write_rows: torch.Tensor | None = None
        # With the native RoPE (Transformer.native_kernel): the R rows' positions, int64 on
        # the host; the layers then get the float32 RoPE tables instead of per-row ones.
        self.positions: torch.Tensor | None = None
        # Padded prompt chunks: the indices of the real tokens among the B · T rows. Only
        # those R rows go through the layers (the residual stream is [R, dim]); attention
        # alone lays them out as [B, T].
        self.real: torch.Tensor | None = None
        # Where the rows' K/V are read: a slice of L token rows (one row on consecutive
        # blocks) or an index [B · 2KV · L] into the layer's [2KV · pool, D] rows.
        self.read: slice | torch.Tensor = slice(0, 0)
        # With `read` an index on the CPU: the token row of each row's positions, int64 [B, L]
        # (the native decode attention reads K/V through it, in place).
        self.token_rows: torch.Tensor | None = None
        self.length = 0  # L: positions attended (the longest row's end)
        self.mask: torch.Tensor | None = None  # bool (True = attend) or additive (0 / -inf)
        self.causal = False
        # Sliding layers: bool [B, 1, T, L], True where a key lies within the window of the
        # query (and is attended at all); None when no query's window excludes a key.
        self.window_mask: torch.Tensor | None = None


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
    rope_cos_local: torch.Tensor
    rope_sin_local: torch.Tensor

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
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        for name in ("rope_cos", "rope_sin", "rope_cos_local", "rope_sin_local"):
            self.register_buffer(name, torch.empty(0, config.head_dim, device=META))
        # The native kernel module (the loader sets it under "auto" on the CPU): RoPE and the
        # K/V write run in it, from float32 tables (rope_f32, rope_f32_local: cos, sin).
        self.native_kernel: Any = None
        # The loader may keep the embedding quantised (engine.model.embedding): ids → float32
        # rows; then tok_embeddings is empty.
        self.embedding: nn.Module | None = None
        none = torch.empty(0, config.head_dim)
        self.rope_f32 = self.rope_f32_local = (none, none)

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.device

    def init_rope(self, positions: int) -> None:
        """Precompute RoPE tables for positions 0..positions-1 on the model's device.

        cos is `[P, D]` (each frequency twice); sin carries the sign of rotate-half,
        (-sin, +sin), so that RoPE(x) = x·cos + roll(x, D/2)·sin.
        """
        c = self.config
        native = self.native_kernel is not None
        if (
            self.rope_cos.device == self.device
            and self.rope_cos.shape[0] >= positions
            and (not native or self.rope_f32[0].shape[0] >= positions)
        ):
            return
        half = c.head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) / half
        inv = 1.0 / (c.rope_base**exponents)  # [D/2]
        if c.rope_freq_factors:  # Llama 3.x: each frequency divided by its factor
            inv = inv / torch.tensor(c.rope_freq_factors, dtype=torch.float64)
        cos, sin = self._rope_table(inv / c.rope_scale, positions)
        self.rope_cos, self.rope_sin = self._in_act(cos), self._in_act(sin)
        if native:
            self.rope_f32 = (cos.float(), sin.float())
        if c.has_local_rope:  # gemma3's sliding layers: their own base, unscaled
            inv_local = 1.0 / ((c.rope_base_local or c.rope_base) ** exponents)
            cos, sin = self._rope_table(inv_local, positions)
            self.rope_cos_local, self.rope_sin_local = self._in_act(cos), self._in_act(sin)
            if native:
                self.rope_f32_local = (cos.float(), sin.float())

    @staticmethod
    def _rope_table(inv: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 cos and signed sin `[P, D]` for the inverse frequencies `inv` [D / 2]."""
        ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]  # [P, D/2]
        cos, sin = ang.cos(), ang.sin()
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def _in_act(self, table: torch.Tensor) -> torch.Tensor:
        return table.to(self.act_dtype).to(self.device)

    def forward_steps(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        # start_pos, tables and lengths are read on the host to place the rows: pass CPU
        # tensors (a device tensor costs a GPU sync per forward)
        start_pos: torch.Tensor,  # [B] int64: position of input_ids[:, 0] in each row
        tables: torch.Tensor,  # [B, W] int64: each row's KV blocks in position order
        kv: KVCache,
        *,
        lengths: torch.Tensor | None = None,  # [B] int64: real tokens per row (default T)
        all_logits: bool = False,
    ) -> Generator[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the model over the rows, writing their K/V; return float32 logits.

        Returns `[B, V]` (each row's last real token) or `[B, T, V]` with `all_logits` (at
        padding, garbage). Every row continues its own sequence from its `start_pos` and
        attends to its own cached prefix and its own new tokens only: decode rows (T == 1) of
        different lengths, or prompt chunks (T > 1), several of them packed into one batch
        by padding the shorter ones to T (`lengths`). Row b's position p lives in block
        `tables[b, p // BLOCK_TOKENS]`; its table must cover its last position (entries past
        that are ignored). Rows never share a block they write. Padding is never written.
        Padding costs nothing in the layers: only real tokens go through them (the rows of
        `at.real`). With `partial_sums`, yields each row-parallel partial output `[R, dim]`
        (R: the real tokens, B · T without padding) and continues with the tensor sent back
        (the sum over ranks, same shape).
        """
        b, t = input_ids.shape
        c, dev = self.config, self.device
        starts = start_pos.tolist()
        lens = [t] * b
        if lengths is not None:
            lens = lengths.tolist()
            if not all(1 <= n <= t for n in lens):
                raise ValueError(f"row lengths must be within 1 .. T = {t}, got {lens}")
        ends = [s + n for s, n in zip(starts, lens, strict=True)]
        length = max(ends)
        n_blocks = blocks_for(length)
        if tables.shape[1] < n_blocks:
            raise ValueError(
                f"position {length - 1} needs {n_blocks} KV blocks; the tables have "
                f"{tables.shape[1]}"
            )
        self.init_rope(length)
        at = _Placement()
        at.b, at.t, at.length = b, t, length
        self._place_blocks(at, tables[:, :n_blocks], starts, ends, kv.layers[0].shape[1])
        if t > 1 and (b > 1 or lens[0] != t):  # prompt chunks packed into one batch
            positions = self._place_packed(at, start_pos, lens)
        elif b == 1:  # one prompt chunk, or one decode row
            positions = start_pos.to(dev) + torch.arange(t, device=dev)  # [T]
            if t > 1 and starts[0] == 0:
                at.causal = True
            elif t > 1:  # a chunk after a cached prefix: query i sees keys 0 .. start + i
                cols = torch.arange(length, device=dev)
                at.mask = (cols[None, :] <= positions[:, None])[None, None]  # [1, 1, T, L]
        else:  # decode rows, one token each
            positions = start_pos.to(dev)  # [B]
            if min(ends) != length:
                cols = torch.arange(length, device=dev)
                ends_t = torch.tensor(ends, device=dev)
                # additive (0 / -inf in the activation dtype): the same scores as a bool
                # mask, without SDPA converting one in every layer (~4 us a layer at B = 8)
                attend = cols[None, :] < ends_t[:, None]
                at.mask = torch.zeros(attend.shape, dtype=self.act_dtype, device=dev)
                at.mask.masked_fill_(~attend, float("-inf"))
                at.mask = at.mask[:, None, None]  # [B, 1, 1, L]
        if c.sliding_window and length > c.sliding_window:
            # [B, T] query positions: each query sees keys pos - W < k <= pos (its last W)
            qpos = positions.view(b, -1)
            cols = torch.arange(length, device=dev)
            at.window_mask = (
                (cols <= qpos[..., None]) & (cols > qpos[..., None] - c.sliding_window)
            )[:, None]  # [B, 1, T, L]
        ids = input_ids.to(dev).reshape(-1)
        if at.real is not None:  # padded chunks: the layers see the real tokens only
            ids, positions = ids[at.real], positions[at.real]
        if self._native_rope(kv):
            at.positions = positions.to(torch.int64).contiguous()
            rope = self.rope_f32
            rope_local = self.rope_f32_local if c.has_local_rope else rope
        else:
            rope = self._rope_rows(positions, self.rope_cos, self.rope_sin)
            rope_local = rope
            if c.has_local_rope:
                rope_local = self._rope_rows(positions, self.rope_cos_local, self.rope_sin_local)
        embedding = self.embedding
        x = (
            F.embedding(ids, self.tok_embeddings) if embedding is None else embedding(ids)
        )  # [N, dim]
        x = x.to(self.residual_dtype)
        if c.embed_scale != 1.0:  # gemma; in the residual dtype, as transformers rounds it
            x = x * torch.tensor(c.embed_scale, dtype=x.dtype)
        act, partial = self.act_dtype, self.partial_sums
        for i, layer in enumerate(self.layers):
            layer_rope = rope_local if layer.sliding else rope
            x = yield from layer.steps(x, layer_rope, kv.layers[i], at, act, partial)  # type: ignore[operator]
        if at.real is None:
            x = x.view(b, t, c.dim)
            if not all_logits:  # each row's last real token: [B, dim]
                last = None if lengths is None else lengths.to(dev) - 1
                x = x[:, -1] if last is None else x[torch.arange(b, device=dev), last]
        elif all_logits:  # back to [B, T] (padding rows: zeros)
            x = x.new_zeros(b * t, c.dim).index_copy_(0, at.real, x).view(b, t, c.dim)
        else:  # each row's last real token: the real rows are in order, row after row
            x = x[torch.tensor(list(itertools.accumulate(lens)), device=dev) - 1]
        x = F.rms_norm(x, (c.dim,), self.norm, c.rms_eps).to(act)
        logits = self.output(x).float()
        if c.final_softcap:  # gemma2
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def _native_rope(self, kv: KVCache) -> bool:
        """Whether RoPE and the K/V write run in the native kernel: on the CPU, activations
        and cache in bfloat16 or float32, the cache's layers contiguous."""
        if self.native_kernel is None or self.device.type != "cpu":
            return False
        kinds = (torch.bfloat16, torch.float32)
        cache = kv.layers[0]
        return self.act_dtype in kinds and cache.dtype in kinds and cache.is_contiguous()

    def _place_blocks(
        self,
        at: _Placement,
        tables: torch.Tensor,
        starts: list[int],
        ends: list[int],
        pool_tokens: int,
    ) -> None:
        """Fill `at.write` and `at.read` from the rows' block tables `[B, blocks_for(L)]`
        (host): slices of the pool's token rows, or indices into each layer's K/V flattened
        to `[2KV · pool_tokens, D]` (an index_select there is ~6x faster than indexing the
        token dimension, and gathers straight into the `[B, 2KV, L, D]` attention reads)."""
        dev, length = self.device, at.length
        first = int(tables[0, 0])
        if at.b == 1 and tables[0].tolist() == list(range(first, first + tables.shape[1])):
            base = first * BLOCK_TOKENS  # consecutive blocks: one slice of the pool
            at.write = slice(base + starts[0], base + ends[0])
            at.write_rows = torch.arange(base + starts[0], base + ends[0])
            at.read = slice(base, base + length)
            return
        cols = torch.arange(length)
        offsets = cols % BLOCK_TOKENS
        rows = tables.repeat_interleave(BLOCK_TOKENS, dim=1)[:, :length] * BLOCK_TOKENS + offsets
        # Positions past a row's end (another row is longer) read the zeroed null block, never
        # stale or uninitialised memory: masked garbage could be NaN, and NaN - inf is NaN.
        beyond = cols[None, :] >= torch.tensor(ends)[:, None]
        rows = torch.where(beyond, NULL_BLOCK * BLOCK_TOKENS + offsets, rows)  # [B, L]
        heads = torch.arange(2 * self.config.n_kv_heads) * pool_tokens  # [2KV]
        at.read = (heads[None, :, None] + rows[:, None, :]).reshape(-1).to(dev)  # [B·2KV·L]
        if dev.type == "cpu":
            at.token_rows = rows.contiguous()
        spans = zip(starts, ends, strict=True)
        written = torch.cat([rows[i, s:e] for i, (s, e) in enumerate(spans)])  # [R]
        at.write_rows = written
        at.write = (heads[:, None] + written[None, :]).reshape(-1).to(dev)  # [2KV · R]

    def _place_packed(
        self, at: _Placement, start_pos: torch.Tensor, lens: list[int]
    ) -> torch.Tensor:
        """Fill `at` for B prompt chunks padded to T tokens; return the N = B · T positions.

        Row b's real tokens go to positions start_b .. start_b + len_b - 1. A padding token
        takes its row's last real position (so it stays inside the RoPE tables and attends to
        its own row only); it is not written to the cache, so it can never be attended by
        anyone, and its output is dropped.
        """
        dev, b, t = self.device, at.b, at.t
        lens_t = torch.tensor(lens, device=dev)[:, None]  # [B, 1]
        offsets = torch.arange(t, device=dev)[None, :]  # [1, T]
        pos = start_pos.to(dev)[:, None] + torch.minimum(offsets, lens_t - 1)  # [B, T]
        if sum(lens) != b * t:
            real = offsets < lens_t  # [B, T]
            at.real = real.reshape(-1).nonzero().squeeze(1)  # [R] indices into N
        # Query (b, i) sees its own row's keys up to its own position: the cached prefix,
        # then its chunk causally. Keys past a row's end (another row's length) never.
        cols = torch.arange(at.length, device=dev)
        at.mask = (cols <= pos[:, :, None])[:, None]  # [B, 1, T, L]
        return pos.reshape(-1)

    def _rope_rows(
        self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for rows at `positions` [N], over all heads: [N, H + 2KV, D].

        Q and K heads rotate; the V heads (the last KV) get cos = 1, sin = 0.
        """
        c = self.config
        n, qk_heads = positions.shape[0], c.n_heads + c.n_kv_heads
        cos = cos_table[positions][:, None].expand(n, qk_heads, c.head_dim)
        sin = sin_table[positions][:, None].expand(n, qk_heads, c.head_dim)
        ones = cos.new_ones(n, c.n_kv_heads, c.head_dim)
        zeros = sin.new_zeros(n, c.n_kv_heads, c.head_dim)
        return torch.cat((cos, ones), dim=1), torch.cat((sin, zeros), dim=1)


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
