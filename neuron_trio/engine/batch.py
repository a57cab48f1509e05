"""A step's forwards, no engine state: its inputs as tensors (the decode rows and the packed
prefill chunks), the runner's calls, and its logits laid out a row per sampled sequence; and
the probe's one-token forward on its own block.

The runner's contract (`runner.Runner.forward`): token ids on the model's device; start
positions, block tables and lengths as host tensors (the model reads them without a GPU
sync). Block tables are padded with the null block, whose K/V stay zero, so a padded read
never sees uninitialised memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_trio.engine.block_pool import NULL_BLOCK, PROBE_BLOCK
from neuron_trio.engine.model.runner import Runner
from neuron_trio.engine.scheduler import PrefillChunk, StepPlan
from neuron_trio.engine.sequence import Sequence


@dataclass(frozen=True)
class ForwardInputs:
    """One `runner.forward` call's arguments."""

    ids: torch.Tensor  # [B, T] int64, on the model's device
    start_pos: torch.Tensor  # [B] int64, host
    tables: torch.Tensor  # [B, W] int64, host
    lengths: torch.Tensor | None = None  # [B] real tokens per row when rows are padded


def block_tables(tables: list[list[int]]) -> torch.Tensor:
    """Rows' block tables as one host tensor `[B, longest]`, padded with the null block."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables], dtype=torch.int64)


def decode_inputs(rows: list[Sequence], device: torch.device) -> ForwardInputs:
    """One token a row: each decoding sequence's last token at its next position."""
    ids = torch.tensor([[s.last_token] for s in rows], dtype=torch.int64)
    return ForwardInputs(
        ids=ids.to(device),
        start_pos=torch.tensor([s.decode_pos for s in rows], dtype=torch.int64),
        tables=block_tables([s.blocks for s in rows]),
    )


def prefill_inputs(chunks: list[PrefillChunk], device: torch.device) -> ForwardInputs:
    """Every chunk in one batch: rows padded to the longest with token 0 (the model neither
    caches nor attends padding), each continuing its own blocks; `lengths` only when some
    row is padded."""
    sizes = [c.end - c.start for c in chunks]
    width = max(sizes)
    tokens = [
        c.seq.tokens(c.start, c.end) + [0] * (width - n) for c, n in zip(chunks, sizes, strict=True)
    ]
    lengths = None
    if min(sizes) != width:
        lengths = torch.tensor(sizes, dtype=torch.int64)
    return ForwardInputs(
        ids=torch.tensor(tokens, dtype=torch.int64).to(device),
        start_pos=torch.tensor([c.start for c in chunks], dtype=torch.int64),
        tables=block_tables([c.seq.blocks for c in chunks]),
        lengths=lengths,
    )


def sampled_rows(plan: StepPlan) -> list[Sequence]:
    """The sequences that sample a token from this step's logits, in the order their logits
    come: decode rows, prefill chunks that complete a prompt, then their forks (n choices)."""
    sampled = [*plan.decode, *(c.seq for c in plan.prefill if c.samples)]
    return sampled + [f for seq in sampled for f in seq.forks]


def row_logits(rows: list[Sequence], logits: list[torch.Tensor]) -> torch.Tensor:
    """The step's logits `[len(rows), V]`, a row for each of `sampled_rows`: the forwards'
    rows, then for each fork its parent's again (a fork samples its first token from them)."""
    batch = logits[0] if len(logits) == 1 else torch.cat(logits, dim=0)
    parents = {id(f): i for i, seq in enumerate(rows) for f in seq.forks}
    forked = [parents[id(seq)] for seq in rows[len(batch) :]]
    if forked:
        batch = torch.cat([batch, batch[forked]], dim=0)
    return batch


def run_plan(
    runner: Runner, plan: StepPlan, prompt_rows: dict[int, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The step's forwards (decode rows, then the prefill chunks in one batch); the logits
    of the rows that sample, in `sampled_rows` order but for the forks.

    The chunks of sequences that collect their prompt's logprobs run in a forward of their
    own that keeps every row's logits: `prompt_rows[i]` gets chunk i's `[length, V]`."""
    device = runner.device
    logits: list[torch.Tensor] = []
    if plan.decode:
        at = decode_inputs(plan.decode, device)
        logits.append(runner.forward(at.ids, at.start_pos, at.tables))
    chunks = plan.prefill
    full = [i for i, c in enumerate(chunks) if c.seq.collects_prompt_logprobs]
    if chunks and not full:
        at = prefill_inputs(chunks, device)
        out = runner.forward(at.ids, at.start_pos, at.tables, lengths=at.lengths)
        done = [i for i, c in enumerate(chunks) if c.samples]
        if done:
            logits.append(out if len(done) == len(chunks) else out[done])
    elif chunks:
        last = _prefill_apart(runner, chunks, full, prompt_rows)
        sampled = [last[i] for i, c in enumerate(chunks) if c.samples]
        if sampled:
            logits.append(torch.stack(sampled))
    return logits


def _prefill_apart(
    runner: Runner,
    chunks: list[PrefillChunk],
    full: list[int],
    prompt_rows: dict[int, torch.Tensor] | None,
) -> list[torch.Tensor]:
    """The chunks `full` in a forward that keeps all their rows (into `prompt_rows`), the
    others in one of their own; each chunk's last row's logits `[V]`, in chunk order."""
    last: list[torch.Tensor | None] = [None] * len(chunks)
    plain = [i for i in range(len(chunks)) if i not in full]
    for group, every in ((plain, False), (full, True)):
        if not group:
            continue
        at = prefill_inputs([chunks[i] for i in group], runner.device)
        out = runner.forward(at.ids, at.start_pos, at.tables, lengths=at.lengths, all_logits=every)
        for row, i in enumerate(group):
            if every:
                size = chunks[i].end - chunks[i].start
                rows = out[row, :size]
                if prompt_rows is not None:
                    prompt_rows[i] = rows
                last[i] = rows[size - 1]
            else:
                last[i] = out[row]
    return [x for x in last if x is not None]


def probe(runner: Runner, token: int) -> None:
    """One tiny forward (`token` alone) on the probe's own KV block; touches no sequence."""
    device = runner.device
    with torch.inference_mode():
        out = runner.forward(
            torch.tensor([[token]], dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64),  # host tensors, as in `step`
            torch.tensor([[PROBE_BLOCK]], dtype=torch.int64),
        )
        # Wait for the result: CUDA returns before its kernels (and a TP step's
        # collectives) have run, and a probe must see a device or collective that hangs.
        out.reshape(-1)[0].item()
