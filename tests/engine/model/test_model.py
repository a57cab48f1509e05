"""The Llama model on tiny random GGUF files: reference maths, KV cache, batching, TP, dtypes."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.kv_cache import KVCache
from neuron_trio.engine.model.linear import (
    DENSE_MIN_ROWS,
    NATIVE_DENSE_MIN_ROWS,
    Int4Linear,
    Int8Linear,
    Linear,
    LinearLayer,
    Q4Linear,
    Q8Linear,
    RefinedHead,
    dense_prefill_rows,
)
from neuron_trio.engine.model.load import loader, packing
from neuron_trio.engine.model.load.loader import ShardFn, SingleRunner, load_transformer
from neuron_trio.engine.model.load.sizing import estimate_kv_bytes, estimate_weight_bytes
from neuron_trio.engine.model.runner import Runner
from tests.engine.model.weight_reads import record_weight_reads
from tests.engine.slot_runner import SlotRunner, slot_pool_blocks, slot_tables
from tests.engine.tiny_gguf import tiny_vocab, tiny_weights, write_tiny_llama

SHAPE: dict[str, Any] = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
ROPE_BASE = 500.0  # small base: positions rotate visibly within a short test sequence


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny")
    return {
        q: write_tiny_llama(d / f"{q}.gguf", **SHAPE, qtype=q, rope_base=ROPE_BASE)
        for q in ("F32", "Q4_1")
    }


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def reference_logits(ids: list[int]) -> torch.Tensor:
    """A plain float64 Llama forward over one sequence, written from the maths: [T, V]."""
    tokens, _, _ = tiny_vocab()
    w = {
        k: torch.from_numpy(v).double()
        for k, v in tiny_weights(**SHAPE, vocab_size=len(tokens), tied=True, seed=0).items()
    }
    h_n, kv_n, dim = SHAPE["n_heads"], SHAPE["n_kv_heads"], SHAPE["dim"]
    d = dim // h_n
    t = len(ids)
    pos = torch.arange(t, dtype=torch.float64)[:, None]
    freq = ROPE_BASE ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    cos, sin = (pos * freq).cos()[:, None], (pos * freq).sin()[:, None]  # [T, 1, D/2]

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, heads, D], rotating the two halves
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    x = w["token_embd.weight"][ids]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(SHAPE["n_layers"]):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(t, h_n, d))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(t, kv_n, d))
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, kv_n, d)
        k = k.repeat_interleave(h_n // kv_n, dim=1)  # query head j uses KV head j // group
        v = v.repeat_interleave(h_n // kv_n, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(t, h_n * d)
        x = x + o @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, len(tiny_vocab()[0]), size=n).tolist()


def test_float32_matches_reference_maths(files: dict[str, Path]) -> None:
    ids = prompt(11, 0)
    model = load_transformer(files["F32"], dtype="float32", device="cpu")
    runner = SlotRunner(model, slots=2, context=32)
    got = runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([1]), all_logits=True)
    assert got.dtype == torch.float32 and got.shape == (1, 11, model.config.vocab_size)
    torch.testing.assert_close(got[0].double(), reference_logits(ids), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_and_decode_match_full_prefill(files: dict[str, Path]) -> None:
    ids = torch.tensor([prompt(10, 1)])
    model = load_transformer(files["F32"], dtype="float32", device="cpu")
    runner = SlotRunner(model, slots=3, context=16)
    full = runner.forward(ids, torch.tensor([0]), torch.tensor([0]), all_logits=True)[0]
    last = runner.forward(ids, torch.tensor([0]), torch.tensor([2]))
    torch.testing.assert_close(last[0], full[-1])
    # Chunks of 4, 4, 2 continuing slot 1.
    parts = [
        runner.forward(ids[:, s : s + 4], torch.tensor([s]), torch.tensor([1]), all_logits=True)[0]
        for s in (0, 4, 8)
    ]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-5, atol=1e-5)
    # One token at a time in slot 2 (overwriting its earlier prefill).
    steps = [
        runner.forward(ids[:, i : i + 1], torch.tensor([i]), torch.tensor([2]))[0]
        for i in range(10)
    ]
    torch.testing.assert_close(torch.stack(steps), full, rtol=1e-5, atol=1e-5)


def greedy_alone(runner: SingleRunner, ids: list[int], n: int, slot: int) -> list[int]:
    logits = runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([slot]))
    out = [int(logits.argmax())]
    for i in range(n - 1):
        pos = torch.tensor([len(ids) + i])
        logits = runner.forward(torch.tensor([[out[-1]]]), pos, torch.tensor([slot]))
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("slot_order", ["contiguous", "scattered"])
def test_batch_of_8_decodes_like_each_alone(files: dict[str, Path], slot_order: str) -> None:
    model = load_transformer(files["F32"], dtype="float32", device="cpu")
    # scattered: the slots' blocks interleave, so every row is read by a gather
    runner = SlotRunner(model, slots=9, context=48, scattered=slot_order == "scattered")
    prompts = [prompt(3 + 2 * i, 10 + i) for i in range(8)]  # different lengths
    n = 10
    alone = [greedy_alone(runner, p, n, slot=8) for p in prompts]
    slots = list(range(8)) if slot_order == "contiguous" else [3, 0, 5, 1, 7, 2, 6, 4]
    tokens = []
    for p, s in zip(prompts, slots, strict=True):
        logits = runner.forward(torch.tensor([p]), torch.tensor([0]), torch.tensor([s]))
        tokens.append([int(logits.argmax())])
    pos = torch.tensor([len(p) for p in prompts])
    for i in range(n - 1):
        last = torch.tensor([[t[-1]] for t in tokens])
        logits = runner.forward(last, pos + i, torch.tensor(slots))
        assert logits.shape == (8, model.config.vocab_size)
        for row, t in zip(logits, tokens, strict=True):
            t.append(int(row.argmax()))
    assert tokens == alone


def packed_batch(
    chunks: list[tuple[list[int], int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, start) chunks as a padded batch: input_ids [B, T], start_pos [B], lengths [B]."""
    width = max(len(ids) for ids, _ in chunks)
    ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in chunks])
    starts = torch.tensor([start for _, start in chunks])
    return ids, starts, torch.tensor([len(ids) for ids, _ in chunks])


def test_packed_prefill_matches_each_prompt_alone(files: dict[str, Path]) -> None:
    model = load_transformer(files["F32"], dtype="float32", device="cpu")
    runner = SlotRunner(model, slots=9, context=32)
    long, mid, short, one = prompt(13, 20), prompt(9, 21), prompt(4, 22), prompt(1, 23)
    # Alone, each in the scratch slot 8: all logits of the whole prompt.
    alone = [
        runner.forward(torch.tensor([p]), torch.tensor([0]), torch.tensor([8]), all_logits=True)[0]
        for p in (long, mid, short, one)
    ]
    # Stale K/V in the slots the packed rows use, NaN included: it must not leak into any row
    # (a gather reads the null block past a row's end; NaN - inf would be NaN).
    rows = {slot: runner.token_rows(slot) for slot in range(4)}
    noise = torch.randn_like(runner.kv.storage) * 100
    noise[..., ::7] = float("nan")
    for slot_rows in rows.values():
        runner.kv.storage[:, :, slot_rows] = noise[:, :, slot_rows]
    # `long` was cached up to 5 in slot 2, by an earlier chunk; the other rows start afresh.
    runner.forward(torch.tensor([long[:5]]), torch.tensor([0]), torch.tensor([2]))
    ids, starts, lengths = packed_batch([(mid, 0), (long[5:], 5), (short, 0), (one, 0)])
    slots = torch.tensor([3, 2, 0, 1])  # not contiguous: read by a gather
    seen: list[int] = []  # rows through each layer's projections: the real tokens only
    projections: list[Any] = [layer.wqkv for layer in model.layers]
    for linear in projections:

        def counted(x: torch.Tensor, project: Any = linear.forward) -> torch.Tensor:
            seen.append(x.shape[0])
            return project(x)  # type: ignore[no-any-return]

        linear.forward = counted
    got = runner.forward(ids, starts, slots, lengths=lengths)
    for linear in projections:
        del linear.forward
    assert seen == [9 + 8 + 4 + 1] * len(model.layers)  # not B x T = 4 x 9
    want = torch.stack([alone[1][-1], alone[0][-1], alone[2][-1], alone[3][-1]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Every real position's logits too (padding positions give garbage, ignored).
    every = runner.forward(ids, starts, slots, lengths=lengths, all_logits=True)
    for row, (ref, start, n) in enumerate(
        [(alone[1], 0, 9), (alone[0], 5, 8), (alone[2], 0, 4), (alone[3], 0, 1)]
    ):
        torch.testing.assert_close(every[row, :n], ref[start : start + n], rtol=1e-5, atol=1e-5)
    # Padding was never written: past each row's end its slot still holds the noise.
    for slot, end in ((3, 9), (2, 13), (0, 4), (1, 1)):
        past = rows[slot][end:]
        kept = runner.kv.storage[:, :, past]
        torch.testing.assert_close(kept, noise[:, :, past], rtol=0, atol=0, equal_nan=True)
    # Then greedy decoding goes on from the packed prefill exactly as from each alone.
    tokens = [[int(row.argmax())] for row in got]
    pos = torch.tensor([9, 13, 4, 1])
    for i in range(6):
        logits = runner.forward(torch.tensor([[t[-1]] for t in tokens]), pos + i, slots)
        for row, t in zip(logits, tokens, strict=True):
            t.append(int(row.argmax()))
    want_tokens = [greedy_alone(runner, p, 7, slot=8) for p in (mid, long, short, one)]
    assert tokens == want_tokens


def test_packed_rows_without_padding_and_a_padded_single_row(files: dict[str, Path]) -> None:
    model = load_transformer(files["F32"], dtype="float32", device="cpu")
    runner = SlotRunner(model, slots=4, context=16)
    a, b = prompt(6, 30), prompt(6, 31)
    want = [
        runner.forward(torch.tensor([p]), torch.tensor([0]), torch.tensor([3]))[0] for p in (a, b)
    ]
    got = runner.forward(torch.tensor([a, b]), torch.tensor([0, 0]), torch.tensor([0, 1]))
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)
    one = runner.forward(
        torch.tensor([[*a[:4], 0, 0]]),
        torch.tensor([0]),
        torch.tensor([2]),
        lengths=torch.tensor([4]),
    )
    alone = runner.forward(torch.tensor([a[:4]]), torch.tensor([0]), torch.tensor([3]))
    torch.testing.assert_close(one, alone, rtol=1e-5, atol=1e-5)


def shard_for(rank: int, tp: int) -> ShardFn:
    """A minimal TP slicing rule for tests: heads and FFN split, output rows/cols split."""
    column = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
    row = ("attn_output", "ffn_down")

    def shard(name: str, w: torch.Tensor) -> torch.Tensor:
        part = name.split(".")[-2]
        if part in column:
            return w.chunk(tp, dim=0)[rank].contiguous()
        if part in row:
            return w.chunk(tp, dim=1)[rank].contiguous()
        return w

    return shard


def run_lockstep(gens: list[Generator[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Drive shard generators like TPRunner: sum each round of partials, send it back."""
    try:
        partials = [next(g) for g in gens]
        while True:
            total = torch.stack(partials).sum(0)
            partials = [g.send(total) for g in gens]
    except StopIteration as done:
        results = [done.value]
        for g in gens[1:]:
            try:
                g.send(total)
            except StopIteration as d:
                results.append(d.value)
        for r in results[1:]:
            torch.testing.assert_close(r, results[0])
        return results[0]


def test_tensor_parallel_shards_sum_to_the_whole(files: dict[str, Path]) -> None:
    tp = 2
    whole = load_transformer(files["F32"], dtype="float32", device="cpu")
    shards = [
        load_transformer(files["F32"], dtype="float32", device="cpu", shard=shard_for(r, tp), tp=tp)
        for r in range(tp)
    ]
    assert shards[0].partial_sums and shards[0].config.n_heads == 2
    assert shards[0].config.n_kv_heads == 1 and shards[0].config.ffn_dim == 64
    caches = [
        KVCache.allocate(m.config, slot_pool_blocks(2, 32), torch.float32, "cpu") for m in shards
    ]
    ref = SlotRunner(whole, slots=2, context=32)

    def tables(slot_ids: list[int]) -> torch.Tensor:
        return slot_tables(torch.tensor(slot_ids), 2, 32)

    ids = torch.tensor([prompt(7, 3)])
    with torch.inference_mode():
        got = run_lockstep(
            [
                m.forward_steps(ids, torch.tensor([0]), tables([1]), c, all_logits=True)
                for m, c in zip(shards, caches, strict=True)
            ]
        )
        # then a decode row on top of the cached prefix
        nxt = run_lockstep(
            [
                m.forward_steps(torch.tensor([[5]]), torch.tensor([7]), tables([1]), c)
                for m, c in zip(shards, caches, strict=True)
            ]
        )
    want = ref.forward(ids, torch.tensor([0]), torch.tensor([1]), all_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    want_next = ref.forward(torch.tensor([[5]]), torch.tensor([7]), torch.tensor([1]))
    torch.testing.assert_close(nxt, want_next, rtol=1e-4, atol=1e-4)
    # and a packed prefill of two padded rows, one continuing slot 1
    ids, starts, lengths = packed_batch([(prompt(3, 5), 8), (prompt(6, 6), 0)])
    with torch.inference_mode():
        packed = run_lockstep(
            [
                m.forward_steps(ids, starts, tables([1, 0]), c, lengths=lengths)
                for m, c in zip(shards, caches, strict=True)
            ]
        )
    want_packed = ref.forward(ids, starts, torch.tensor([1, 0]), lengths=lengths)
    torch.testing.assert_close(packed, want_packed, rtol=1e-4, atol=1e-4)


def test_unsharded_model_never_yields(files: dict[str, Path]) -> None:
    model = load_transformer(files["F32"], dtype="float32", device="cpu")
    kv = KVCache.allocate(model.config, 3, torch.float32, "cpu")
    gen = model.forward_steps(torch.tensor([[4, 5]]), torch.tensor([0]), torch.tensor([[2]]), kv)
    with pytest.raises(StopIteration) as done, torch.inference_mode():
        next(gen)
    assert done.value.value.shape == (1, model.config.vocab_size)


@pytest.mark.parametrize("length", [12, 24])  # 24: auto's prefill takes the dense copies
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "auto"])
def test_other_dtypes_track_float32(files: dict[str, Path], dtype: str, length: int) -> None:
    ids = torch.tensor([prompt(length, 4)])
    ref = SlotRunner(
        load_transformer(files["Q4_1"], dtype="float32", device="cpu"), slots=1, context=32
    )
    model = load_transformer(files["Q4_1"], dtype=dtype, device="cpu")
    runner = SlotRunner(model, slots=1, context=32)
    want = ref.forward(ids, torch.tensor([0]), torch.tensor([0]), all_logits=True)[0]
    got = runner.forward(ids, torch.tensor([0]), torch.tensor([0]), all_logits=True)[0]
    assert got.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.99, cos
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_runner_protocol_and_kv_bytes(files: dict[str, Path]) -> None:
    model = load_transformer(files["F32"], dtype="float32", device="cpu")
    runner: Runner = SingleRunner(model, blocks=7, context=40)
    assert runner.blocks == 7 and runner.context == 40 and runner.device == torch.device("cpu")
    c = model.config
    assert isinstance(runner, SingleRunner)
    expected = 2 * c.n_layers * 7 * 16 * c.n_kv_heads * c.head_dim * 4  # blocks of 16 tokens
    assert runner.kv.nbytes == expected == KVCache.bytes_needed(c, 7, torch.float32)
    bf = SingleRunner(model, blocks=3, context=8, kv_dtype=torch.bfloat16)
    assert bf.kv.nbytes == KVCache.bytes_needed(c, 3, torch.bfloat16)
    # the null block reads as zeros from the start; the rest is left uninitialised
    assert not runner.kv.storage[:, :, :16].any()


def test_kv_pool_size_by_budget_or_by_batch_and_context(files: dict[str, Path]) -> None:
    with GGUFFile(files["F32"]) as gf:
        c = gf.config
    per_block = KVCache.bytes_per_block(c, torch.float32)
    assert per_block == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 16 * 4
    # 0: max_batch x context tokens (context rounded up to whole blocks), plus 2 reserved
    by_batch = KVCache.blocks_for_budget(c, torch.float32, budget_mb=0, max_batch=3, context=40)
    assert by_batch == 3 * 3 + 2
    by_budget = KVCache.blocks_for_budget(c, torch.float32, budget_mb=1, max_batch=3, context=40)
    assert by_budget == (1 << 20) // per_block
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.blocks_for_budget(
            replace(c, n_layers=4096), torch.float32, budget_mb=1, max_batch=1, context=16
        )


def estimate_model_bytes(path: Path, dtype: str, context: int, max_batch: int) -> int:
    """Weights plus KV cache on the CPU, as service.placement adds them up."""
    with GGUFFile(path) as gf:
        weights = estimate_weight_bytes(gf, dtype, "cpu")
        kv = estimate_kv_bytes(
            gf.config, dtype, "cpu", kv_cache_mb=0, max_batch=max_batch, context=context
        )
        return weights + kv


@pytest.mark.parametrize(
    ("dtype", "copies"), [("float32", "1"), ("bfloat16", "1"), ("auto", "1"), ("auto", "0")]
)
def test_estimate_model_bytes_is_close(
    files: dict[str, Path], dtype: str, copies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEURON_DENSE_COPIES", copies)  # with and without the prefill copies
    model = load_transformer(files["Q4_1"], dtype=dtype, device="cpu")
    seen: set[int] = set()
    weights = 0
    for name, buf in model.named_buffers():
        if name.startswith("rope_") or buf.untyped_storage().data_ptr() in seen:
            continue
        seen.add(buf.untyped_storage().data_ptr())
        weights += buf.untyped_storage().nbytes()
    kv = KVCache.bytes_needed(model.config, 3 * 4 + 2, model.act_dtype)
    est = estimate_model_bytes(files["Q4_1"], dtype, 64, 3)
    assert 0.9 * (weights + kv) <= est <= 1.1 * (weights + kv)


def test_rows_past_context_and_bad_batches_are_refused(files: dict[str, Path]) -> None:
    runner = SlotRunner(
        load_transformer(files["F32"], dtype="float32", device="cpu"), slots=2, context=8
    )
    with pytest.raises(ValueError, match="KV blocks"):
        runner.forward(torch.tensor([[1] * 14]), torch.tensor([4]), torch.tensor([0]))
    two = (torch.tensor([[1, 2], [3, 4]]), torch.tensor([0, 0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="row lengths"):
        runner.forward(*two, lengths=torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="row lengths"):
        runner.forward(*two, lengths=torch.tensor([3, 1]))
    # padding is not a real position: a row that ends at the context fits beside a longer one
    full = runner.forward(
        torch.tensor([[1, 2, 3], [4, 0, 0]]),
        torch.tensor([0, 7]),
        torch.tensor([0, 1]),
        lengths=torch.tensor([3, 1]),
    )
    assert full.shape == (2, runner.config.vocab_size)


def test_gguf_file_object_is_accepted(files: dict[str, Path]) -> None:
    with GGUFFile(files["F32"]) as gf:
        model = load_transformer(gf, dtype="float32", device="cpu")
    assert model.config == gf.config and model.config.tied_output


@pytest.mark.parametrize("int4_head", [False, True])
def test_auto_head_refines_its_best_candidates_exactly(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, int4_head: bool
) -> None:
    monkeypatch.setattr(loader, "AUTO_INT4_HEAD", int4_head)
    model = load_transformer(files["Q4_1"], dtype="auto", device="cpu")
    head = model.output
    if not isinstance(head, RefinedHead):
        pytest.skip("no int kernels on this build (auto is float32)")
    native = packing.native_kernel() is not None  # the native kernel's layers, if built
    int8 = Q8Linear if native else Int8Linear
    int4 = Q4Linear if native else Int4Linear
    assert isinstance(head.coarse, int4 if int4_head else int8)
    head.refine = 8
    x = torch.randn(3, model.config.dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = head(x)  # [3, V]
    vocab = model.config.vocab_size
    # the float32 table (tied embedding), or its file blocks' rows (Q8_0: kept as blocks)
    table = (
        model.tok_embeddings if model.embedding is None else model.embedding(torch.arange(vocab))
    )
    assert table.shape == (vocab, model.config.dim)
    exact = x.float() @ table.T
    coarse = head.coarse(x).float()
    top = coarse.topk(8, dim=-1).indices  # the candidates it refines
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(got[rest], coarse[rest])  # the tail keeps the coarse logits
    many = torch.randn(
        20, model.config.dim, generator=torch.Generator().manual_seed(1)
    ).bfloat16()  # prefill-sized: the dense table
    torch.testing.assert_close(head(many), many.float() @ table.T)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_separate_output_head(tmp_path: Path, dtype: str) -> None:
    path = write_tiny_llama(tmp_path / "untied.gguf", **SHAPE, qtype="Q4_0", tied=False)
    ids = torch.tensor([prompt(9, 5)])
    ref = SlotRunner(load_transformer(path, dtype="float32", device="cpu"), slots=1, context=16)
    model = load_transformer(path, dtype=dtype, device="cpu")
    assert not model.config.tied_output
    got = SlotRunner(model, slots=1, context=16).forward(ids, torch.tensor([0]), torch.tensor([0]))
    want = ref.forward(ids, torch.tensor([0]), torch.tensor([0]))
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.97  # tiny random model
    est = estimate_model_bytes(path, dtype, 16, 1)
    assert est > KVCache.bytes_needed(model.config, 3, model.act_dtype)


@pytest.mark.parametrize("gelu", [False, True])
def test_every_projection_has_one_interface_norm_and_gate_in_torch_by_default(gelu: bool) -> None:
    assert all(
        issubclass(kind, LinearLayer)
        for kind in (Linear, Int4Linear, Int8Linear, Q4Linear, Q8Linear)
    )
    torch.manual_seed(0)
    w = torch.randn(8, 6)
    layer = Linear(w)
    x, norm = torch.randn(3, 6), torch.rand(6) + 0.5
    want = torch.nn.functional.rms_norm(x, (6,), norm, 1e-5) @ w.T
    torch.testing.assert_close(layer.normed(x, norm, 1e-5, torch.float32), want)
    gate_up = torch.randn(3, 12)
    act = torch.nn.functional.gelu(gate_up[:, :6], approximate="tanh") if gelu else None
    if act is None:
        act = torch.nn.functional.silu(gate_up[:, :6])
    torch.testing.assert_close(layer.gated(gate_up, gelu), (act * gate_up[:, 6:]) @ w.T)


def test_dense_prefill_rows_are_the_fewest_at_which_a_kept_dense_copy_takes_over() -> None:
    weight, scales = torch.ones(16, 32, dtype=torch.int8), torch.ones(16)
    without = Int8Linear(weight, scales)
    with_copy = Int8Linear(weight, scales, dense=torch.ones(16, 32, dtype=torch.bfloat16))
    assert dense_prefill_rows(torch.nn.Sequential(without, Linear(torch.ones(4, 4)))) is None
    assert dense_prefill_rows(torch.nn.Sequential(without, with_copy)) == DENSE_MIN_ROWS


@pytest.mark.parametrize("copies", [True, False])
def test_a_runner_says_whether_its_native_layers_keep_dense_copies(
    files: dict[str, Path], copies: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEURON_DENSE_COPIES", "1" if copies else "0")
    model = load_transformer(files["Q4_1"], dtype="auto")
    runner = SingleRunner(model, blocks=8, context=64)
    assert runner.dense_prefill_rows == (NATIVE_DENSE_MIN_ROWS if copies else None)


@pytest.mark.skipif(packing.native_kernel() is None, reason="the native kernel is not built here")
def test_a_q8_0_head_is_packed_from_the_files_rows_a_slice_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coarse pass of a Q8_0 head is packed slice by slice from the file's blocks, never
    dequantised whole, and comes out as packing the whole float32 head would make it."""
    path = write_tiny_llama(tmp_path / "q8.gguf", qtype="Q8_0", seed=2)  # 288 rows, tied
    monkeypatch.setattr(packing, "_CHUNK_ROWS", 64)  # 4 slices and a part
    read = record_weight_reads(monkeypatch)
    with GGUFFile(path) as gf:
        head = load_transformer(gf, dtype="auto").output
        assert "token_embd.weight" not in read
        whole = packing.pack_q4_symmetric(gf.weight("token_embd.weight"))
    kernel = packing.native_kernel()
    want = Q4Linear(kernel, *whole, None, out_dtype=torch.float32, coarse=True)
    assert isinstance(head, RefinedHead) and isinstance(head.coarse, Q4Linear)
    got = dict(head.coarse.kernel_tensors())
    for name, tensor in want.kernel_tensors():
        assert torch.equal(got[name], tensor), name
