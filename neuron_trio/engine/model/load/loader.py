"""GGUF file → `Transformer` on a device; `SingleRunner` (sizes: engine/model/load/sizing.py).

The model is built on the meta device, then each weight is dequantised from the memory-mapped
file, sliced for this rank by `shard` (tensor parallelism), converted and assigned: no weight
is ever held twice in full. Each GGUF weight reaches `shard` by name (e.g.
"blk.0.attn_q.weight") as a logical float32 tensor `[out, in]` (Q/K un-permuted) or `[n]`
for norms; the shard returns this rank's slice (norms, token_embd and output whole).

dtype:
- "float32": every weight dequantised to float32; the reference numerics.
- "bfloat16", "float16": dense weights and activations in that type.
- "auto": the fastest path measured on the device. CUDA: bfloat16. CPU: weights stay
  quantised, bfloat16 activations and a float32 residual stream. Where the native kernel
  (`_cpu_kernel.c`, packing.native_kernel) was built: 4- and 5-bit groups of 32 (Q4_0, Q4_1,
  Q4_K, Q5_0, Q5_1, Q5_K weights: their own codes, see packing_kind) and int8 with one scale
  per row (the output head's coarse pass, and weights in other formats) run in it with int8
  activations, RMSNorm and SwiGLU fused in, and so do RoPE with the K/V write and decode
  attention; elsewhere torch's int4 (groups of 32) and int8 (one scale per row) kernels. The
  head's best candidates are recomputed exactly (see AUTO_INT4_HEAD). A fused projection
  whose parts the file stores in different formats is one layer per format (StackedLinear).
  A layer in torch's int kernels also keeps a bfloat16 copy for long prefill chunks, where
  a dense GEMM beats them (from 16 rows); a native layer only where the CPU has AMX
  (packing.native_dense_copies: from 48 rows), elsewhere its kernel takes prefill too.
  bench/bench_decode.py measures it (against llama.cpp too) and prints auto's top-1
  agreement with float32.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import cast

import torch

from neuron_trio.engine.gguf import families, quant
from neuron_trio.engine.gguf.file import GGUFFile, unpermute_qk
from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.engine.model import arena
from neuron_trio.engine.model.embedding import FileEmbedding, FileRows, QuantizedEmbedding
from neuron_trio.engine.model.kv_cache import KVCache
from neuron_trio.engine.model.linear import (
    Int4Linear,
    Int8Linear,
    Linear,
    LinearLayer,
    Q4Linear,
    Q8Linear,
    RefinedHead,
    StackedLinear,
    dense_prefill_rows,
)
from neuron_trio.engine.model.load import cached_load, packing
from neuron_trio.engine.model.load.load_phases import LoadPhases
from neuron_trio.engine.model.load.weight_cache import WeightCache
from neuron_trio.engine.model.transformer import Block, Transformer, run_to_end
from neuron_trio.errors import ModelLoadError

ShardFn = Callable[[str, torch.Tensor], torch.Tensor]

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DENSE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "auto" on CPU: the output head's coarse pass is 4-bit (the native kernel; torch's int4
# elsewhere; one int8 pass of the activations), then each row's HEAD_REFINE best logits are
# recomputed exactly from the table (float32, or the file's Q8_0 blocks: linear.RefinedHead).
# Decode reads the head every step and is bound by memory: on a
# 151,936-token vocabulary the int8 pass was a third of the bytes a step reads, and 4 bits
# halve it. Top-1 agreement with float32 (bench/bench_decode.py's parity prompts, 8 x 24
# positions) is the same as with the int8 pass on the built-in model, Gemma 3 and Qwen2.5
# (191, 181, 188 of 192); the coarse tail moves the mean KL divergence from float32 from
# 0.0002 / 0.0128 / 0.0025 to 0.0011 / 0.0140 / 0.0029 nats per token, which 256 exact
# candidates (not 64: 0.0026 / 0.0159 / 0.0035) keep small. With the coarse pass's one int8
# pass the agreement is 192, 181, 190 of 192.
AUTO_INT4_HEAD = True
HEAD_REFINE = 256  # candidates per row recomputed exactly
# How "auto" on the CPU keeps each format's projections (`packing_kind`; the start-up log
# names what each format of the file got, `scheme_note`). The native kernel's 4- and 5-bit
# layers are w = scale · q + minimum per group of 32: Q4_0, Q4_1, Q4_K and Q5_0, Q5_1, Q5_K
# are that, and keep their own codes ("codes4", "codes5": quant.affine_codes). IQ4_NL and
# IQ4_XS (a non-linear grid), Q3_K, Q8_0, and Q2_K, Q6_K (scales per 16 weights) take the
# kernel's int8 layer with a scale per 32 ("int8g": quant.int8_codes, exact but for Q2_K's and
# Q6_K's 8-bit grid); floats (and those formats without the native kernel) the int8 layer
# with one scale per row ("int8"), rather than a coarser requantisation: repacked as 4-bit
# groups, IQ4 and Q3_K files lost their text on half the parity prompts
# (bench/bench_fidelity.py). A 4-bit format whose codes cannot be
# read where the layer is built (a tensor-parallel shard, a part of a fused tensor, no
# native kernel) is repacked from its floats ("float4": packing.pack_q4, torch's int4).
FOUR_BIT = quant.FOUR_BIT
SCHEME_LABELS = {
    "codes4": "its own 4-bit codes",
    "codes5": "its own 5-bit codes",
    "float4": "4-bit groups repacked from its floats",
    "int8": "int8 rows (wider than the format)",
    "int8g": "int8 codes, a scale per 32",
}


_PROJECTIONS = tuple(
    f".{p}.weight"
    for p in (
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_qkv",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_gate_up",
        "ffn_down",
    )
)


def packing_kind(gf: GGUFFile, name: str, native: bool, sharded: bool) -> str:
    """How "auto" on the CPU packs projection `name` (a key of SCHEME_LABELS)."""
    qtype = gf.tensors[gf.storage_name(name)].qtype
    # the file's own codes only for a whole tensor: a fused part's rows are a slice of them
    codes = native and not sharded and not gf.is_fused_part(name)
    if qtype in quant.AFFINE and codes:
        return "codes4" if qtype in FOUR_BIT else "codes5"
    if qtype in quant.GROUPED8 and codes:
        return "int8g"
    return "float4" if qtype in FOUR_BIT else "int8"


def scheme_note(gf: GGUFFile, names: list[str], native: bool, sharded: bool) -> str:
    """`Q4_0 projections: its own 4-bit codes; …`: what each format of `names` got."""
    got: dict[str, set[str]] = {}
    for name in names:
        qtype = quant.qtype_name(gf.tensors[gf.storage_name(name)].qtype)
        got.setdefault(qtype, set()).add(packing_kind(gf, name, native, sharded))
    parts = [
        f"{qtype}: {', '.join(SCHEME_LABELS[k] for k in sorted(kinds))}"
        for qtype, kinds in sorted(got.items())
    ]
    return "projections " + "; ".join(parts)


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """The concrete scheme for `dtype` on `device`: float32 | bfloat16 | float16 | cpu-int."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    if device.type == "cpu" and packing.int4_available():
        return "cpu-int"
    return "bfloat16" if device.type == "cuda" else "float32"


def scheme_dtypes(scheme: str) -> tuple[torch.dtype, torch.dtype]:
    """(activation dtype, residual dtype) of a scheme."""
    if scheme == "cpu-int":
        return torch.bfloat16, torch.float32
    dt = _DENSE[scheme]
    return dt, (torch.float32 if dt == torch.float32 else dt)


def load_transformer(
    source: str | os.PathLike[str] | GGUFFile,
    *,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    shard: ShardFn | None = None,
    tp: int = 1,
    weight_cache: WeightCache | None = None,
    phases: LoadPhases | None = None,
) -> Transformer:
    """Build the model of a GGUF file on `device` (one TP shard of it when `tp > 1`).

    With `tp > 1` the model has `config.shard(tp)`'s shape and `partial_sums=True`; `shard`
    must then slice each weight for this rank. Raises ModelLoadError (UnsupportedModelError
    for an unsupported file) naming the file and the tensor.

    `weight_cache`: under "cpu-int" with tp = 1, the built layers come from it when it holds
    this file and build (`weight_cache.snapshot_key`), and go into it otherwise. `phases`
    receives the seconds each part of the load took (`load_phases`).
    """
    phases = LoadPhases() if phases is None else phases
    if isinstance(source, GGUFFile):
        return _Load(source, dtype, torch.device(device), shard, tp, weight_cache, phases).run()
    with phases.phase("parse"):
        gf = GGUFFile(source)
    with gf:
        return _Load(gf, dtype, torch.device(device), shard, tp, weight_cache, phases).run()


class _Load:
    """One model's load: the file, where its weights go, and the named steps that build its
    parts (`block`, `linear`, `tables`, `head`, …), each reading the state kept here.

    Tensor parallelism (`shard`): each weight sliced for this rank after dequantising. The
    native kernel ("auto" on the CPU) takes the projections, decode attention (see Block)
    and the head's coarse pass."""

    def __init__(
        self,
        gf: GGUFFile,
        dtype: str,
        device: torch.device,
        shard: ShardFn | None,
        tp: int,
        weight_cache: WeightCache | None,
        phases: LoadPhases,
    ) -> None:
        if tp > 1 and shard is None:
            raise ModelLoadError(f"tp = {tp} needs a shard function")
        self.gf, self.device, self.shard, self.tp, self.phases = gf, device, shard, tp, phases
        self.scheme = resolve_dtype(dtype, device)
        self.act, self.residual = scheme_dtypes(self.scheme)
        self.config = gf.config.shard(tp) if tp > 1 else gf.config  # this rank's shapes
        native = self.scheme == "cpu-int" and device.type == "cpu"
        self.kernel = packing.native_kernel() if native else None
        self.cached = cached_load.open_slots(
            gf,
            weight_cache if native and shard is None else None,
            self.scheme,
            device,
            # the prefill copies are part of what a slot holds: a switched setting repacks
            f"int4_head={AUTO_INT4_HEAD}; refine={HEAD_REFINE}; "
            f"dense_copies={packing.native_dense_copies()}",
            phases,
        )
        self.projections: list[str] = []  # every projection's logical name, for scheme_note

    def run(self) -> Transformer:
        """The steps in order: the blocks, the final norm, the tables, the arena, the cache."""
        c, kernel = self.config, self.kernel
        model = Transformer(
            c, partial_sums=self.tp > 1, act_dtype=self.act, residual_dtype=self.residual
        )
        model.scheme = self.scheme
        for i, layer in enumerate(model.layers):
            self.block(layer, f"blk.{i}.")
            cast(Block, layer).attend_kernel = kernel
        if self.scheme == "cpu-int":  # the start-up log says how each format of the file is kept
            sharded = self.shard is not None
            self.phases.note(scheme_note(self.gf, self.projections, kernel is not None, sharded))
        model.native_kernel = kernel  # RoPE and the K/V write (Transformer.forward_steps)
        model.norm = self.vector("output_norm.weight")
        self.tables(model)
        if kernel is not None and not self.cached.hit:  # a hit reads its file's memory, in order
            with self.phases.phase("arena"):
                self.cached.moved(arena.gather(arena.decode_order(model)))
        self.cached.finish()
        model.init_rope(min(self.gf.config.context_length, 4096))
        model.eval()
        return model

    # ---- reading the file ----------------------------------------------------------------

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Weight `name` as float32, this rank's slice, checked against `shape`."""
        with self.phases.phase("dequantize"):  # with the un-permutation and the shard's slice
            w = self.gf.weight(name)
        if self.shard is not None:
            w = self.shard(name, w)
        if tuple(w.shape) != shape:
            raise ModelLoadError(
                f"{self.gf.path}: tensor {name} has shape {tuple(w.shape)} for this rank, "
                f"expected {shape}"
            )
        return w

    def vector(self, name: str) -> torch.Tensor:
        return self.get(name, (self.config.dim,)).to(device=self.device, dtype=self.residual)

    def kind(self, name: str) -> str:
        return packing_kind(self.gf, name, self.kernel is not None, self.shard is not None)

    def codes(self, name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """A whole tensor's own codes (quant.int8_codes or affine_codes), rows as `weight`'s."""
        gf, c = self.gf, self.config
        qtype = quant.QType(gf.tensors[name].qtype)  # shape checked at open: check_llama_shapes
        read = quant.int8_codes if qtype in quant.GROUPED8 else quant.affine_codes
        parts = read(gf.raw(name), qtype, shape)
        if gf.config.arch in families.PERMUTED_QK and name.endswith(
            (".attn_q.weight", ".attn_k.weight")
        ):
            heads = c.n_heads if name.endswith(".attn_q.weight") else c.n_kv_heads
            return tuple(unpermute_qk(part, heads) for part in parts)  # the rows, as `weight`
        return parts

    # ---- the steps -----------------------------------------------------------------------

    def block(self, layer: torch.nn.Module, p: str) -> None:
        """Block `p` ("blk.N."): its norms, projections and biases."""
        c, hd, device, act = self.config, self.config.head_dim, self.device, self.act
        qkv_shapes = [
            (c.n_heads * hd, c.dim),
            (c.n_kv_heads * hd, c.dim),
            (c.n_kv_heads * hd, c.dim),
        ]
        layer.attn_norm = self.vector(p + "attn_norm.weight")
        layer.ffn_norm = self.vector(p + "ffn_norm.weight")
        qkv = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        layer.wqkv = self.linear(qkv, qkv_shapes)
        if c.qkv_bias:  # qwen2
            biases = [
                self.get(n.replace(".weight", ".bias"), (s[0],))
                for n, s in zip(qkv, qkv_shapes, strict=True)
            ]
            layer.qkv_bias = torch.cat(biases).to(device=device, dtype=act)
        if c.qk_norm:  # one weight per head dim, the same for every head: [H + KV, D]
            q_norm = self.get(p + "attn_q_norm.weight", (hd,)).expand(c.n_heads, hd)
            k_norm = self.get(p + "attn_k_norm.weight", (hd,)).expand(c.n_kv_heads, hd)
            layer.qk_norm = torch.cat((q_norm, k_norm)).to(device=device, dtype=act)
        if c.post_norms:  # gemma
            layer.post_attn_norm = self.vector(p + "post_attention_norm.weight")
            layer.post_ffn_norm = self.vector(p + "post_ffw_norm.weight")
        layer.wo = self.linear([p + "attn_output.weight"], [(c.dim, c.n_heads * hd)])
        layer.w_gate_up = self.linear(
            [p + "ffn_gate.weight", p + "ffn_up.weight"], [(c.ffn_dim, c.dim), (c.ffn_dim, c.dim)]
        )
        layer.w_down = self.linear([p + "ffn_down.weight"], [(c.dim, c.ffn_dim)])

    def linear(self, names: list[str], shapes: list[tuple[int, int]]) -> torch.nn.Module:
        """One projection over the rows of `names` (from the cache when it has it)."""
        self.projections.extend(names)
        return self.cached.slot("+".join(names), lambda: self.build_linear(names, shapes))

    def build_linear(self, names: list[str], shapes: list[tuple[int, int]]) -> torch.nn.Module:
        """One layer per run of a packing kind (StackedLinear where the runs are several)."""
        runs: list[tuple[list[str], list[tuple[int, int]]]] = []
        for name, shape in zip(names, shapes, strict=True):
            if runs and self.kind(runs[-1][0][-1]) == self.kind(name):
                runs[-1][0].append(name)
                runs[-1][1].append(shape)
            else:
                runs.append(([name], [shape]))
        if len(runs) == 1 or self.kernel is None:
            return self.one_format(names, shapes)
        return StackedLinear([cast(LinearLayer, self.one_format(*run)) for run in runs])

    def one_format(self, names: list[str], shapes: list[tuple[int, int]]) -> torch.nn.Module:
        """A layer over tensors of one packing kind: from the file's own codes where the kind
        keeps them, else from the float32 weights."""
        kinds = {self.kind(n) for n in names}
        scheme, device, gf = self.scheme, self.device, self.gf
        if kinds not in ({"codes4"}, {"codes5"}, {"int8g"}):
            w = torch.cat([self.get(n, s) for n, s in zip(names, shapes, strict=True)], dim=0)
            with self.phases.phase("pack"):
                return make_linear(w, scheme, device, four_bit=kinds == {"float4"})

        def weight() -> torch.Tensor:  # only where the layer needs it (a dense copy): rare
            return torch.cat([gf.weight(n) for n in names], dim=0)

        with self.phases.phase("pack"):
            per_tensor = [self.codes(n, s) for n, s in zip(names, shapes, strict=True)]
            joined = tuple(torch.cat(col, dim=0) for col in zip(*per_tensor, strict=True))
            if kinds == {"int8g"}:
                q8, scale8 = joined
                return make_linear(weight, scheme, device, four_bit=False, grouped=(q8, scale8))
            q, scale, minimum = joined
            return make_linear(weight, scheme, device, four_bit=False, codes=(q, scale, minimum))

    def tables(self, model: Transformer) -> None:
        """The token embedding and the output head (from the cache when it has them)."""
        c = self.config
        head_name = "token_embd.weight" if c.tied_output else "output.weight"
        # The head's exact rows stay the file's blocks (RefinedHead's q8_dim; the native refine
        # reads Q8_0's): a quarter of a float32 table or less, the same values.
        blocks = self.scheme == "cpu-int" and block_rows(self.gf, head_name, c.dim)
        self.embedding(model, blocks)
        if c.tied_output and self.scheme != "cpu-int":
            model.output = Linear(model.tok_embeddings)  # the same tensor: no second copy
            return
        model.output = self.cached.slot("output", lambda: self.head(model, head_name, blocks))

    def embedding(self, model: Transformer, head_blocks: bool) -> None:
        c, scheme = self.config, self.scheme
        if (
            scheme == "cpu-int"
            and (not c.tied_output or head_blocks)
            and quantized_rows_fit(self.gf, c.dim)
        ):
            # only looked up (and, tied, read by the refinement): the file's blocks, rows
            # dequantised per step (embedding.py); untied, only a step's rows are read, from
            # the file itself: neither held nor in the weight cache
            with self.phases.phase("tables"):
                model.embedding = (
                    self.cached.slot("token_embd", lambda: _rows(self.gf))
                    if c.tied_output
                    else _file_rows(self.gf)
                )
            model.tok_embeddings = torch.empty(0, c.dim, device=self.device)
            return

        def table() -> torch.Tensor:
            embed = self.get("token_embd.weight", (c.vocab_size, c.dim))
            # The embedding table keeps float32 unless the whole model is a dense half type.
            table_dtype = self.act if scheme in ("bfloat16", "float16") else torch.float32
            return embed.to(device=self.device, dtype=table_dtype)

        model.tok_embeddings = self.cached.slot("token_embd.weight", table)

    def head(self, model: Transformer, head_name: str, blocks: bool) -> torch.nn.Module:
        """The output head: dense, or (cpu-int) a coarse int pass + exact top candidates
        (tied: from the embedding table itself)."""
        c = self.config
        if self.scheme != "cpu-int":
            head = self.get(head_name, (c.vocab_size, c.dim))
            return make_linear(head, self.scheme, self.device, four_bit=False)
        native_ok = self.kernel is not None and c.dim % packing.INT4_GROUP == 0
        native_ok = native_ok and c.vocab_size % packing.Q4_TILE == 0
        qtype = quant.QType(self.gf.tensors[head_name].qtype)
        if blocks and AUTO_INT4_HEAD and native_ok:
            return self.head_from_blocks(self.table_rows(model, head_name), qtype)
        head = self.get(head_name, (c.vocab_size, c.dim))
        table = (
            self.table_rows(model, head_name)
            if blocks
            else model.tok_embeddings
            if c.tied_output
            else head.to(self.device)
        )
        with self.phases.phase("pack"):
            coarse = self.coarse_pass(head, native_ok)
        return RefinedHead(coarse, table, HEAD_REFINE, q8_dim=c.dim if blocks else 0, qtype=qtype)

    def head_from_blocks(self, table: torch.Tensor, qtype: quant.QType) -> torch.nn.Module:
        """The coarse pass packed from the exact table's rows (the file's blocks) a slice at a
        time (its shape checked when the file was opened: check_llama_shapes): the float32
        head, 545 MB for Qwen2.5 0.5B's, is never whole in memory."""
        c = self.config
        with self.phases.phase("pack"):
            nibbles, scale = packing.pack_rows(
                c.vocab_size,
                lambda a, b: packing.pack_q4_symmetric(
                    quant.dequantize(table[a:b], qtype, (b - a, c.dim))
                ),
            )
        coarse = Q4Linear(self.kernel, nibbles, scale, None, out_dtype=torch.float32, coarse=True)
        return RefinedHead(coarse, table, HEAD_REFINE, q8_dim=c.dim, qtype=qtype)

    def coarse_pass(self, head: torch.Tensor, native_ok: bool) -> torch.nn.Module:
        """The head's coarse pass from its float32 rows: 4-bit where a kernel takes it."""
        c = self.config
        if AUTO_INT4_HEAD and native_ok:
            nibbles, scale = packing.pack_q4_symmetric(head)
            return Q4Linear(self.kernel, nibbles, scale, None, out_dtype=torch.float32, coarse=True)
        if AUTO_INT4_HEAD and c.dim % packing.INT4_GROUP == 0 and c.vocab_size % 16 == 0:
            packed, scales_zeros = packing.pack_int4(head)
            return Int4Linear(packed, scales_zeros, c.vocab_size, c.dim, packing.INT4_GROUP)
        if native_ok:
            return Q8Linear(self.kernel, *packing.pack_q8(head))
        return Int8Linear(*packing.pack_int8(head))

    def table_rows(self, model: Transformer, head_name: str) -> torch.Tensor:
        """The exact table as the file's blocks (RefinedHead's q8_dim)."""
        if self.config.tied_output:
            assert isinstance(model.embedding, QuantizedEmbedding)
            return model.embedding.rows  # the same blocks: no second copy
        return self.gf.raw(head_name).reshape(self.config.vocab_size, -1).clone()


def block_rows(gf: GGUFFile, name: str, dim: int) -> bool:
    """Whether tensor `name` is stored whole as rows of `dim` in a block format (not a float
    one): the head's exact table kept as the file stores it (RefinedHead's q8_dim)."""
    info = gf.tensors.get(name)
    if info is None or len(info.shape) != 2 or info.shape[1] != dim:
        return False
    kind = quant.QType(info.qtype)
    if kind in (quant.QType.F32, quant.QType.F16, quant.QType.BF16):
        return False
    return dim % quant.BLOCK_SIZES[kind][0] == 0


def quantized_rows_fit(gf: GGUFFile, dim: int) -> bool:
    """Whether the embedding can stay in the file's blocks (`QuantizedEmbedding`): stored
    whole under its own name, each row a whole number of blocks."""
    info = gf.tensors.get("token_embd.weight")
    if info is None or len(info.shape) != 2 or info.shape[1] != dim:
        return False
    block, _ = quant.BLOCK_SIZES[quant.QType(info.qtype)]
    return dim % block == 0


def _rows(gf: GGUFFile) -> QuantizedEmbedding:
    """The embedding's blocks copied out of the mapping (the file may change on disk)."""
    info = gf.tensors["token_embd.weight"]
    qtype = quant.QType(info.qtype)
    rows = gf.raw("token_embd.weight").reshape(info.shape[0], -1).clone()
    return QuantizedEmbedding(rows, qtype, info.shape[1])


def _file_rows(gf: GGUFFile) -> FileEmbedding:
    """The embedding's blocks read from the file a step's rows at a time."""
    info = gf.tensors["token_embd.weight"]
    qtype = quant.QType(info.qtype)
    row_bytes = quant.raw_nbytes(qtype, info.shape[1])
    rows = FileRows(gf.path, info.offset, info.shape[0], row_bytes)
    return FileEmbedding(rows, qtype, info.shape[1])


def make_linear(
    weight: torch.Tensor | Callable[[], torch.Tensor],
    scheme: str,
    device: torch.device,
    *,
    four_bit: bool,
    codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    grouped: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.nn.Module:
    """A projection for a float32 `[out, in]` weight under `scheme` (see `resolve_dtype`).

    `codes`: the weight's own 4- or 5-bit codes (quant.affine_codes: q, scale, minimum),
    which the native kernel keeps as they are (4 bits where q stays below 16, as
    quant.FOUR_BIT's); where it cannot (no kernel, a shape it does not tile, a scale beyond
    float16), the weight takes the int8 layer. `grouped`: int8 codes with a float16 scale per
    32 (quant.int8_codes), the native kernel's grouped int8 layer where it can take them.
    Under "cpu-int" the layer also keeps a bfloat16 copy for prefill chunks: torch's int
    kernels always, the native kernel's where packing.native_dense_copies() says so. `weight` may be a function that makes it: it is
    called only where the float32 weight is used (with `codes` in the native kernel and
    no dense copy: never, which spares a 0.5B model's first start ~1.5 s of dequantising).
    """
    made: torch.Tensor | None = None

    def full() -> torch.Tensor:
        nonlocal made
        if made is None:
            made = weight if isinstance(weight, torch.Tensor) else weight()
        return made

    if scheme != "cpu-int":
        return Linear(full().to(device=device, dtype=_DENSE[scheme]))
    given = codes if codes is not None else grouped
    out_f, in_f = given[0].shape if given is not None else full().shape
    kernel = packing.native_kernel() if device.type == "cpu" else None
    fits = in_f % packing.INT4_GROUP == 0 and out_f % packing.Q4_TILE == 0

    def dense(native: bool) -> torch.Tensor | None:
        """The layer's bfloat16 copy for prefill chunks, made only where it is kept."""
        if native and not packing.native_dense_copies():
            return None
        return full().to(device=device, dtype=torch.bfloat16)

    if codes is not None and kernel is not None and fits and _finite(codes[1], codes[2]):
        q, scale, minimum = codes
        if int(q.max()) < 16:  # 4-bit codes (Q4_0, Q4_1, Q4_K)
            nibbles = packing.pack_q5(q)[0]  # the same nibbles; no fifth bits
            return Q4Linear(kernel, nibbles, scale, minimum, dense(True))
        nibbles, high = packing.pack_q5(q)
        centred = torch.equal(minimum.float(), scale.float() * -16.0)  # Q5_0: not stored
        stored = None if centred else minimum
        return Q4Linear(kernel, nibbles, scale, stored, dense(True), high=high)
    if grouped is not None and kernel is not None and fits and _finite(grouped[1]):
        return Q8Linear(kernel, grouped[0], grouped[1], dense(True), keep_dtype=True)
    w = full()
    # (its float16 scales: weights beyond float16's range take torch's kernel)
    if four_bit and kernel is not None and fits and float(w.abs().max()) < 6e4:
        return Q4Linear(kernel, *packing.pack_q4(w), dense(True))
    if four_bit and in_f % packing.INT4_GROUP == 0 and out_f % 16 == 0:
        packed, scales_zeros = packing.pack_int4(w)
        return Int4Linear(packed, scales_zeros, out_f, in_f, packing.INT4_GROUP, dense(False))
    if kernel is not None and fits:  # int8, one scale per row, in the native kernel
        return Q8Linear(kernel, *packing.pack_q8(w), dense(True), keep_dtype=True)
    q8, scales = packing.pack_int8(w)
    return Int8Linear(q8, scales, dense(False))


def _finite(*halves: torch.Tensor) -> bool:
    """Whether float16 scales and minimums stayed finite (-8 · d of a huge Q4_0 scale may not)."""
    return all(bool(torch.isfinite(h).all()) for h in halves)


class SingleRunner:
    """The `Runner` of one unsharded model: owns its KV pool, runs each forward to the end.

    `blocks` is the pool's size in blocks, the reserved null and probe blocks included
    (`KVCache.blocks_for_budget`); `context` the positions RoPE is precomputed for.
    `kv_dtype` defaults to the model's activation dtype.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        blocks: int,
        context: int,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.config: LlamaConfig = model.config
        self.blocks = blocks
        self.context = context
        self.device = model.device
        self.dense_prefill_rows = dense_prefill_rows(model)
        self.kv = KVCache.allocate(model.config, blocks, kv_dtype or model.act_dtype, self.device)
        model.init_rope(context)

    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: torch.Tensor,
        tables: torch.Tensor,
        *,
        lengths: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Write the rows' K/V into their blocks; return float32 logits ([B, V] or [B, T, V])."""
        with torch.inference_mode():
            steps = self.model.forward_steps(
                input_ids, start_pos, tables, self.kv, lengths=lengths, all_logits=all_logits
            )
            return run_to_end(steps)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        with torch.inference_mode():
            self.kv.copy_blocks(src, dst)
