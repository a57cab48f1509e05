"""Prompt-lookup (n-gram) speculation: guess a decoding sequence's next tokens from its own
text, check them all in one forward, keep what the model agrees with.

A sequence whose last few tokens occurred before in its prompt or output proposes the tokens
that followed them then (the newest such occurrence of the longest suffix, 3 tokens down to
1: `propose`). The step then runs its last token and the k proposed ones as k + 1 decode rows
of one forward (`verify`: each row one token at its position, all on the sequence's blocks),
writing their K/V at the sequence's next k + 1 positions. The engine samples position 0's logits exactly as
a plain decode step would; while the token it picks equals the proposal, position 1's logits
are those of the next step, and so on: the sequence gets 1 to k + 1 tokens from one read of
the weights. Tokens are picked one at a time with the sequence's own sampler, so greedy
output, penalties, seeds and logprobs are what they would be without speculation; for a
sampled request, keeping a deterministic proposal when the draw equals it is the standard
rejection rule with q(x) = 1 (accept with probability p(x), else draw from p without x).
The K/V written past the last accepted position are garbage that the next steps overwrite;
the blocks beyond the sequence's length go back to the pool (`trim_blocks`).

Adaptive (`DraftState`): k follows the sequence's recent acceptance (one more after a fully
accepted draft, down to what was accepted plus one after a miss); a sequence whose drafts
mostly fail stops proposing for a while (a cool-down that doubles each time), and nothing is
proposed while the batch has more than `max_rows` decode rows (MAX_ROWS: batch 1), where the
weights are already read for several tokens at once.

Not speculated: sequences under a grammar (structured output, a tool call in progress),
whose every token needs its mask first; an `auto` tool call that begins inside an accepted
run ends the run there (the engine's `accept_draft`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from neuron_trio.engine.batch import block_tables
from neuron_trio.engine.block_pool import BLOCK_TOKENS, BlockPool, blocks_for
from neuron_trio.engine.model.runner import Runner
from neuron_trio.engine.sequence import Sequence
from neuron_trio.engine.speculation.draft_model import DraftModel

__all__ = ["MAX_TOKENS", "DraftState", "Speculator", "propose"]

MAX_TOKENS = 16  # the most tokens a draft may have (config: 1 .. 16)
NGRAM_MAX = 3  # the longest suffix looked up
NGRAM_MIN = 1
LOOKBACK = 8192  # the newest tokens searched (bounds a step's search on a long context)
# Adaptive: the acceptance (an exponential average of accepted / proposed) under which a
# sequence stops proposing for a cool-down, which doubles from COOL_MIN to COOL_MAX steps.
ACCEPT_FLOOR = 0.3
EMA_WEIGHT = 0.3
COOL_MIN = 4
COOL_MAX = 256
# Drafts only while at most this many rows decode: at 4 streams of a rename task, 4 x 9
# verification rows beside the plain ones gave half the aggregate tokens/s of plain decode
# (bench_speculative.py --streams 4), while batch 1 gained 1.9-3.6x.
MAX_ROWS = 1


def propose(tokens: np.ndarray, k: int, ngram_max: int = NGRAM_MAX) -> list[int]:
    """Up to `k` tokens that followed the newest earlier occurrence of the longest suffix
    of `tokens` (ngram_max tokens down to NGRAM_MIN); [] when no suffix occurred before."""
    size = len(tokens)
    if size < 2 or k < 1:
        return []
    window = tokens[-LOOKBACK:]
    size = len(window)
    # ends: positions e < size - 1 where the suffix of length n ends (window[e] is the
    # last token), narrowed as n grows; the newest (largest e) of the longest n wins
    ends = np.flatnonzero(window[: size - 1] == window[size - 1])
    best = ends
    for n in range(2, ngram_max + 1):
        ends = ends[ends >= n - 1]
        ends = ends[window[ends - (n - 1)] == window[size - n]]
        if not len(ends):
            break
        best = ends
    if not len(best):
        return []
    start = int(best[-1]) + 1
    return [int(t) for t in window[start : start + k]]


@dataclass
class DraftState:
    """One sequence's speculation: its tokens as an array (for `propose`), its k, its
    recent acceptance and cool-down."""

    k: int
    history: np.ndarray = field(default_factory=lambda: np.zeros(64, dtype=np.int64))
    size: int = 0
    acceptance: float = 1.0
    cool: int = 0  # steps left without proposing
    next_cool: int = COOL_MIN

    def sync(self, seq: Sequence) -> np.ndarray:
        """The sequence's prompt + output as an array (appending what is new since)."""
        total = seq.num_prompt + seq.num_output
        if total > self.size:
            new = seq.tokens(self.size, total)
            if total > len(self.history):
                grown = np.zeros(max(total, 2 * len(self.history)), dtype=np.int64)
                grown[: self.size] = self.history[: self.size]
                self.history = grown
            self.history[self.size : total] = new
            self.size = total
        return self.history[: self.size]

    def record(self, proposed: int, accepted: int, most: int) -> None:
        """A verification's outcome: `accepted` of `proposed` tokens kept (k at most `most`)."""
        self.acceptance += EMA_WEIGHT * (accepted / proposed - self.acceptance)
        self.k = min(most, self.k + 1) if accepted == proposed else max(1, accepted + 1)
        if self.acceptance < ACCEPT_FLOOR:
            self.cool = self.next_cool
            self.next_cool = min(COOL_MAX, 2 * self.next_cool)
            self.acceptance = ACCEPT_FLOOR  # a fresh chance after the cool-down
        elif accepted == proposed:
            self.next_cool = COOL_MIN


@dataclass
class SpeculationCounts:
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # ... that the model agreed with (kept)


class Speculator:
    """Drafts for a step's decode rows and their verification forward (`num_tokens`: the
    most tokens a draft has; `max_rows`: no drafts when more decode rows than this run;
    `draft`: a draft model proposes them, else the prompt lookup does)."""

    def __init__(
        self, num_tokens: int, *, max_rows: int = MAX_ROWS, draft: DraftModel | None = None
    ) -> None:
        if not 1 <= num_tokens <= MAX_TOKENS:
            raise ValueError(f"num_tokens must be within 1 .. {MAX_TOKENS}, got {num_tokens}")
        self.num_tokens = num_tokens
        self.max_rows = max_rows
        self.draft = draft
        self.counts = SpeculationCounts()

    def drafts(self, decode: list[Sequence], pool: BlockPool, context: int) -> dict[int, list[int]]:
        """Each decode row's draft, by seq_id (rows without one are absent), with the blocks
        for its positions taken from the pool's free ones (a draft is cut to what is free,
        never preempting anyone). `context`: positions a row may reach."""
        if self.draft is not None:
            self.draft.release_finished()
        if len(decode) > self.max_rows:
            return {}
        out: dict[int, list[int]] = {}
        for seq in decode:
            draft = self._draft(seq, context)
            if draft:
                draft = draft[: _reserve(seq, pool, len(draft))]
            if draft:
                out[seq.seq_id] = draft
        return out

    def _draft(self, seq: Sequence, context: int) -> list[int]:
        if seq.sampling.grammar is not None:
            return []
        state = seq.draft
        if state is None:
            state = seq.draft = DraftState(k=self.num_tokens)
        if state.cool:
            state.cool -= 1
            return []
        # never past max_tokens (the last token of a run needs no draft) nor the context
        room = (seq.params.max_tokens or 0) - seq.num_output - 1
        k = min(state.k, room, context - 1 - seq.decode_pos)
        if k < 1:
            return []
        if self.draft is not None:
            return self.draft.propose(seq, state.sync(seq), k)
        return propose(state.sync(seq), k)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.counts.proposed += proposed
        self.counts.accepted += accepted
        if seq.draft is not None:
            seq.draft.record(proposed, accepted, self.num_tokens)


def _reserve(seq: Sequence, pool: BlockPool, k: int) -> int:
    """Blocks for `seq`'s next 1 + k positions from the pool's free ones; how many of the k
    draft tokens they cover."""
    need = blocks_for(seq.decode_pos + 1 + k)
    while len(seq.blocks) < need and pool.available:
        seq.blocks.append(pool.allocate())
    return min(k, len(seq.blocks) * BLOCK_TOKENS - seq.decode_pos - 1)


def trim_blocks(seq: Sequence, pool: BlockPool) -> None:
    """Give back the blocks past `seq`'s next decode position (a draft's rejected tail)."""
    keep = blocks_for(seq.decode_pos + 1)
    if len(seq.blocks) > keep:
        pool.free(seq.blocks[keep:])
        del seq.blocks[keep:]


def verify(
    runner: Runner, seqs: list[Sequence], drafts: dict[int, list[int]]
) -> list[torch.Tensor]:
    """One forward of each sequence's last token and its draft; each sequence's logits
    `[1 + len(draft), V]` (position j: the token after draft[:j]).

    Every token is a decode row of its own (one token at its position, the sequence's block
    table): the step's layers write all rows' K/V before any row attends, so row j sees the
    rows before it, and the rows take the decode path (on the CPU, the native kernel's one
    call for all layers), where k + 1 rows cost little more than one."""
    ids: list[int] = []
    starts: list[int] = []
    tables: list[list[int]] = []
    sizes: list[int] = []
    for seq in seqs:
        row = [seq.last_token, *drafts[seq.seq_id]]
        ids += row
        starts += range(seq.decode_pos, seq.decode_pos + len(row))
        tables += [seq.blocks] * len(row)
        sizes.append(len(row))
    out = runner.forward(
        torch.tensor(ids, dtype=torch.int64)[:, None].to(runner.device),
        torch.tensor(starts, dtype=torch.int64),
        block_tables(tables),
    )
    return list(out.split(sizes))
