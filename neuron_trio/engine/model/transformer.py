"""The Llama transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or separate head,
and what its relatives add, switched on by `LlamaConfig` (never by a family's name): Q/K/V
biases, QK-norm, post-attention/post-FFN norms, GELU-tanh, scaled embeddings, soft-capped
attention scores and logits, sliding-window layers (a mask over the full KV rows) with their
own RoPE tables, Llama 3.x's per-frequency RoPE factors.

Built on the meta device by `engine.model.load.loader`, which then assigns every weight (fused QKV and
fused gate/up projections, dense or weight-only int4/int8). The forward pass is a generator,
`Transformer.forward_steps`: a tensor-parallel shard (`partial_sums=True`) yields the partial
output of each row-parallel projection (attention output, MLP down) and continues with the
all-reduced sum sent back; an unsharded model never yields. So the model never imports a
communicator (see docs/ARCHITECTURE.md). Its parts, called as plain functions: attention.py
(decode in the native kernel or SDPA), rope.py (the tables, the native RoPE with the K/V write),
placement.py (where a forward's rows write and read the KV pool).

Shapes: B rows, T new tokens per row, H query heads, KV key/value heads, D head_dim,
L attended positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.engine.model.attention import attend, attend_decode, read_kv
from neuron_trio.engine.model.kv_cache import KVCache
from neuron_trio.engine.model.linear import Linear
from neuron_trio.engine.model.native_decode import plan_for
from neuron_trio.engine.model.placement import (
    Placement,
    output_rows,
    place_rows,
    place_window,
)
from neuron_trio.engine.model.rope import rope_rows, rope_table, rope_write

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
        # not empty_like: on the meta device that imports torch's symbolic shapes and sympy,
        # ~0.4 s of every start of a model with these norms (Gemma 3)
        self.register_buffer(
            "post_ffn_norm", None if post is None else torch.empty(c.dim, device=META)
        )
        self.wqkv: nn.Module = _meta_linear(qkv_out, c.dim)
        self.wo: nn.Module = _meta_linear(c.dim, c.n_heads * c.head_dim)
        self.w_gate_up: nn.Module = _meta_linear(2 * c.ffn_dim, c.dim)
        self.w_down: nn.Module = _meta_linear(c.dim, c.ffn_dim)
        # The native kernel module when decode attention should run in it (the loader sets it
        # under "auto" on CPU; float32, the reference, keeps SDPA).
        self.attend_kernel: Any = None
        self._qk_norm_f32: tuple[torch.Tensor, torch.Tensor] | None = None  # see qk_norm_f32

    def steps(
        self,
        x: torch.Tensor,  # [N, dim] residual stream: B · T rows (row-major), or at.real's
        # cos, signed sin: per row [N, H + 2KV, D], or with at.positions the float32 tables
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,  # this layer's K/V pool: [2KV, pool tokens, D]
        at: Placement,
        act: torch.dtype,
        partial: bool,
    ) -> Generator[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        n = x.shape[0]
        # Modules and buffers straight from their dicts: nn.Module.__getattr__ costs ~0.5 us a
        # lookup, 6 per layer and step.
        mods, bufs = self._modules, self._buffers
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
        if qk_norm is not None and not native_rope:  # RMSNorm over each Q and K head
            qk = F.rms_norm(qkv[:, : h + kv], (d,), eps=self.eps) * qk_norm
            qkv = torch.cat((qk.to(qkv.dtype), qkv[:, h + kv :]), dim=1)
        if native_rope:  # QK-norm, RoPE and the K/V write in one native call: [N, H, D]
            norm = None if qk_norm is None else self.qk_norm_f32()
            q = rope_write(self.attend_kernel, qkv, rope, cache, at, act, h, kv, norm, self.eps)
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
            start = at.window_start if self.sliding else 0
            o = attend_decode(
                self.attend_kernel, q, cache, at, act, mask, self.scale, self.softcap, start
            )
        else:
            # a sliding layer's keys from the earliest query's window on
            keys, values = read_kv(cache, at, act, at.window_start if self.sliding else 0)
            if at.real is not None:  # padded chunks: padding queries are zeros, then dropped
                q = q.new_zeros(at.b * at.t, h, d).index_copy_(0, at.real, q)
            q = q.view(at.b, at.t, h, d).transpose(1, 2)  # [B, H, T, D]
            if kv != h and self.softcap:
                keys = keys.repeat_interleave(h // kv, dim=1)
                values = values.repeat_interleave(h // kv, dim=1)
            o = attend(q, keys, values, mask, causal, self.scale, self.softcap)  # [B, H, T, D]
            o = o.transpose(1, 2).reshape(at.b * at.t, h * d)
            if at.real is not None:
                o = o[at.real]
        o = mods["wo"].forward(o)  # type: ignore[union-attr]  # [N, dim]
        if partial:
            o = yield o
        x = self._residual(x, o, bufs["post_attn_norm"])  # after the all-reduce: the sum
        # [N, 2 · ffn]
        gate_up = mods["w_gate_up"].normed(x, bufs["ffn_norm"], self.eps, act)  # type: ignore[union-attr,operator]
        y = mods["w_down"].gated(gate_up, self.gelu)  # type: ignore[union-attr,operator]
        if partial:
            y = yield y
        return self._residual(x, y, bufs["post_ffn_norm"])

    def _residual(
        self, x: torch.Tensor, o: torch.Tensor, post: torch.Tensor | None
    ) -> torch.Tensor:
        """x + o, or with a post-norm x + RMSNorm(o) · post: in the native kernel where the
        loader gave one (as native_decode's loop does it: the same bits), else in torch."""
        if post is None:
            return x + o
        kernel = self.attend_kernel
        fits = x.dtype == post.dtype == torch.float32 and x.is_contiguous() and self.dim % 8 == 0
        if kernel is None or not fits:
            return x + F.rms_norm(o.to(x.dtype), (self.dim,), post, self.eps)
        o = o.contiguous()
        out = torch.empty_like(x)
        bf16 = int(o.dtype == torch.bfloat16)
        if o.dtype not in (torch.bfloat16, torch.float32):
            o, bf16 = o.float(), 0
        kernel.norm_add(
            x.data_ptr(), o.data_ptr(), bf16, x.shape[0], self.dim, post.data_ptr(), self.eps,
            out.data_ptr(),
        )  # fmt: skip
        return out

    def qk_norm_f32(self) -> torch.Tensor:
        """QK-norm's weights in float32 (the native RoPE's), converted once per buffer."""
        qk_norm = self._buffers["qk_norm"]
        assert qk_norm is not None
        cached = self._qk_norm_f32
        if cached is None or cached[0] is not qk_norm:
            cached = self._qk_norm_f32 = (qk_norm, qk_norm.float().contiguous())
        return cached[1]


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
        # Decode steps' layers in one native call (native_decode.plan_for): False until the
        # first decode step decides, then the plan or None (the Python path)
        self._decode_plan: Any = False

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.device

    def init_rope(self, positions: int, *, torch_tables: bool = False) -> None:
        """Precompute RoPE tables for positions 0..positions-1 on the model's device.

        cos is `[P, D]` (each frequency twice); sin carries the sign of rotate-half,
        (-sin, +sin), so that RoPE(x) = x·cos + roll(x, D/2)·sin. With the native kernel
        only its float32 tables are kept; the tables in the activations' dtype, for torch's
        RoPE, are built when a forward takes that path (`torch_tables`): not a second copy
        beside them (Gemma 3 at 4,096 positions: 8 of 24 MiB; 64 MiB at 32,768).
        """
        c = self.config
        native = self.native_kernel is not None
        want_torch = torch_tables or not native
        have_torch = self.rope_cos.device == self.device and self.rope_cos.shape[0] >= positions
        have_native = not native or self.rope_f32[0].shape[0] >= positions
        if (have_torch or not want_torch) and have_native:
            return
        if native:  # never fewer positions than the native tables have
            positions = max(positions, self.rope_f32[0].shape[0])
        half = c.head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) / half
        inv = 1.0 / (c.rope_base**exponents)  # [D/2]
        if c.rope_freq_factors:  # Llama 3.x: each frequency divided by its factor
            inv = inv / torch.tensor(c.rope_freq_factors, dtype=torch.float64)
        tables = [rope_table(inv / c.rope_scale, positions)]
        if c.has_local_rope:  # gemma3's sliding layers: their own base, unscaled
            tables.append(
                rope_table(1.0 / ((c.rope_base_local or c.rope_base) ** exponents), positions)
            )
        if want_torch:  # (a native model's stay on the meta device until then)
            self.rope_cos, self.rope_sin = (self._in_act(t) for t in tables[0])
            if c.has_local_rope:
                self.rope_cos_local, self.rope_sin_local = (self._in_act(t) for t in tables[1])
        if native:
            self.rope_f32 = (tables[0][0].float(), tables[0][1].float())
            if c.has_local_rope:
                self.rope_f32_local = (tables[1][0].float(), tables[1][1].float())

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
        lens = [t] * b
        if lengths is not None:
            lens = lengths.tolist()
            if not all(1 <= n <= t for n in lens):
                raise ValueError(f"row lengths must be within 1 .. T = {t}, got {lens}")
        pool_tokens, act = kv.layers[0].shape[1], self.act_dtype
        at, positions = place_rows(
            start_pos, lens, t, tables, pool_tokens=pool_tokens, n_kv_heads=c.n_kv_heads,
            act=act, dev=dev,
        )  # fmt: skip
        self.init_rope(at.length)
        if c.sliding_window and at.length > c.sliding_window:
            additive = t == 1 and self.native_kernel is not None  # decode rows, native
            first = int(start_pos.min())
            place_window(at, positions, first, c.sliding_window, act if additive else None)
        ids = input_ids.to(dev).reshape(-1)
        if at.real is not None:  # padded chunks: the layers see the real tokens only
            ids, positions = ids[at.real], positions[at.real]
        if self._native_rope(kv):
            at.positions = positions.to(torch.int64).contiguous()
            rope = self.rope_f32
            rope_local = self.rope_f32_local if c.has_local_rope else rope
        else:
            self.init_rope(at.length, torch_tables=True)
            rope = rope_rows(c, positions, self.rope_cos, self.rope_sin)
            rope_local = rope
            if c.has_local_rope:
                rope_local = rope_rows(c, positions, self.rope_cos_local, self.rope_sin_local)
        embedding = self.embedding
        x = (
            F.embedding(ids, self.tok_embeddings) if embedding is None else embedding(ids)
        )  # [N, dim]
        x = x.to(self.residual_dtype)
        if c.embed_scale != 1.0:  # gemma; in the residual dtype, as transformers rounds it
            x = x * torch.tensor(c.embed_scale, dtype=x.dtype)
        act, partial = self.act_dtype, self.partial_sums
        plan = plan_for(self) if t == 1 and at.positions is not None else None
        native = None if plan is None else plan.run(x, at, kv)  # all layers in one call
        if native is not None:
            x = native
        else:
            for i, layer in enumerate(self.layers):
                layer_rope = rope_local if layer.sliding else rope
                x = yield from layer.steps(x, layer_rope, kv.layers[i], at, act, partial)  # type: ignore[operator]
        x = output_rows(at, x, lens, all_logits)
        logits = self.output(self._final_norm(x).to(act)).float()
        if c.final_softcap:  # gemma2
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the rows that get logits: in the native kernel for float32 rows on the
        CPU (torch's cost a batch-1 step of the built-in model ~0.1 ms, the kernel a few us)."""
        c, kernel, norm = self.config, self.native_kernel, self.norm
        fits = x.dtype == norm.dtype == torch.float32 and x.device.type == "cpu"
        if kernel is None or not fits or c.dim % 8 or x.numel() == 0:
            return F.rms_norm(x, (c.dim,), norm, c.rms_eps)
        rows = x.reshape(-1, c.dim).contiguous()
        out = torch.empty_like(rows)
        kernel.norm_add(
            0, rows.data_ptr(), 0, rows.shape[0], c.dim, norm.data_ptr(), c.rms_eps, out.data_ptr()
        )
        return out.view(x.shape)

    def _native_rope(self, kv: KVCache) -> bool:
        """Whether RoPE and the K/V write run in the native kernel: on the CPU, activations
        and cache in bfloat16 or float32, the cache's layers contiguous."""
        if self.native_kernel is None or self.device.type != "cpu":
            return False
        kinds = (torch.bfloat16, torch.float32)
        cache = kv.layers[0]
        return self.act_dtype in kinds and cache.dtype in kinds and cache.is_contiguous()


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
