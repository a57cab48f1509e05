"""Draft-model speculation: a second, small model of the target's vocabulary proposes a
decoding sequence's next k tokens greedily; the target verifies them as it verifies a prompt
lookup's (speculative.py's `verify` and the engine's `_accept_draft`).

The draft runs at batch 1 on a KV pool of its own (a `SingleRunner` on the target's first
device: under tensor parallelism it is not split). Each sequence it drafts for has a
`DraftCache`: the blocks holding the draft's K/V of the sequence's tokens, and what it
wrote there. A proposal first catches the cache up with the tokens the sequence gained since
(one forward of the new ones, at most `CATCHUP` a step, so a long prompt never makes one
step long), then decodes k - 1 more tokens one at a time. The K/V written past the tokens
the target accepted are found stale at the next proposal (the cache compares what it wrote
with the sequence's tokens) and their blocks are dropped before the draft goes on.

When its sequence finishes (`release_finished`, each step) a cache keeps its full blocks as a
donor: a later sequence whose tokens begin the same (a resent system prompt, a chat's
history) starts its cache on them (shared, never written again) instead of running the draft
over them. When the draft's pool runs out, donors and then the least recently used caches are
dropped (those catch up again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from neuron_trio.engine.batch import block_tables
from neuron_trio.engine.block_pool import BLOCK_TOKENS, BlockPool, blocks_for
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.load.loader import SingleRunner, load_transformer
from neuron_trio.engine.model.load.sizing import engine_sizing
from neuron_trio.engine.model.runner import Runner
from neuron_trio.engine.sequence import Sequence
from neuron_trio.errors import ConfigError

__all__ = ["CATCHUP", "DraftCache", "DraftModel", "load_draft", "vocabulary_mismatch"]

# The most tokens the draft catches up with in one step (a long prompt's first drafts wait
# a few steps rather than make one step as long as its whole prefill).
CATCHUP = 512
# Catch-ups of at most this many tokens run as decode rows (a longer one as a prompt chunk).
ROWS_MAX = 16
# Finished sequences' caches kept for their prefix (the newest).
DONORS = 4
# The draft's KV pool holds this many sequences of the whole context (drafts run at batch 1;
# the second keeps one sequence's cache while another drafts for a while).
POOL_SEQUENCES = 2


@dataclass
class DraftCache:
    """The draft's K/V of one sequence: positions `0 .. sure - 1` hold its tokens; `tail`
    are the draft's own tokens written after them (right only as far as the sequence
    accepted them)."""

    seq: Sequence
    blocks: list[int] = field(default_factory=list)
    sure: int = 0
    tail: list[int] = field(default_factory=list)
    prefix: np.ndarray | None = None  # a donor's: the tokens of its blocks

    def valid(self, tokens: np.ndarray) -> int:
        """How many leading positions hold `tokens`' K/V."""
        ahead = tokens[self.sure : self.sure + len(self.tail)]
        same = np.asarray(self.tail[: len(ahead)], dtype=np.int64) == ahead
        run = int(np.argmin(same)) if not same.all() else len(ahead)
        return self.sure + run


class DraftModel:
    """Greedy batch-1 drafts from `runner` (a small model of the target's vocabulary)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.pool = BlockPool(runner.blocks, prefix_cache=False)
        self.caches: OrderedDict[int, DraftCache] = OrderedDict()  # by seq_id, oldest first
        self.donors: OrderedDict[int, DraftCache] = OrderedDict()  # finished, oldest first

    def propose(self, seq: Sequence, tokens: np.ndarray, k: int) -> list[int]:
        """Up to `k` tokens the draft expects after `tokens` (`seq`'s prompt + output);
        [] while its cache is still catching up or its pool has no room."""
        cache = self.caches.pop(seq.seq_id, None) or self._adopt(DraftCache(seq), tokens)
        self.caches[seq.seq_id] = cache  # the newest
        total = len(tokens)
        k = min(k, self.runner.context - total)
        start = min(cache.valid(tokens), total - 1)  # the last token is always fed
        self._keep(cache, start)
        end = min(total, start + CATCHUP)
        if k < 1 or not self._room(cache, (end if end < total else total + k - 1)):
            return []
        logits = self._forward(cache, tokens[start:end].tolist(), start)
        cache.sure = end
        if end < total:
            return []
        draft = [int(logits.argmax())]
        for i in range(1, k):
            cache.tail.append(draft[-1])
            logits = self._forward(cache, [draft[-1]], total + i - 1)
            draft.append(int(logits.argmax()))
        return draft

    def release_finished(self) -> None:
        """The caches of sequences that finished (or were cancelled) become donors of their
        full blocks (`DONORS` at most: the oldest are dropped)."""
        for seq_id in [i for i, c in self.caches.items() if c.seq.is_finished]:
            cache = self.caches.pop(seq_id)
            self._keep(cache, cache.sure // BLOCK_TOKENS * BLOCK_TOKENS)
            cache.prefix = np.asarray(cache.seq.tokens(0, cache.sure), dtype=np.int64)
            self.donors[seq_id] = cache
        while len(self.donors) > DONORS:
            self._drop_donor()

    def clear(self) -> None:
        """Drop every cache and donor (their blocks back to the pool)."""
        while self.donors:
            self._drop_donor()
        for seq_id in list(self.caches):
            self._drop(seq_id)

    def _adopt(self, cache: DraftCache, tokens: np.ndarray) -> DraftCache:
        """A new cache on the donor blocks that hold the longest prefix of `tokens` (not
        its last token, which is always fed). Only a donor of the same cache salt (tenant,
        or prefix-cache group) is used, as in the prefix cache: a skipped catch-up would tell
        one tenant that another sent the same prefix."""
        full, source = 0, None
        for donor in self.donors.values():
            assert donor.prefix is not None
            if donor.seq.cache_root != cache.seq.cache_root:
                continue
            n = min(len(donor.prefix), len(tokens) - 1)
            same = donor.prefix[:n] == tokens[:n]
            common = n if same.all() else int(np.argmin(same))
            if common // BLOCK_TOKENS > full:
                full, source = common // BLOCK_TOKENS, donor
        if source is not None:
            cache.blocks = source.blocks[:full]
            self.pool.share(cache.blocks)
            cache.sure = full * BLOCK_TOKENS
        return cache

    def _forward(self, cache: DraftCache, ids: list[int], start: int) -> torch.Tensor:
        """The draft's logits `[V]` after `ids` written at `start ..` on the cache's blocks.

        A few tokens (the usual catch-up: the last accepted ones) go as decode rows, one
        token each at its position, as `speculative.verify` runs them: the decode kernel
        takes them for little more than one row, where a chunk of 2-16 would cost several."""
        if len(ids) <= ROWS_MAX:
            rows = torch.tensor(ids, dtype=torch.int64)[:, None]
            starts = torch.arange(start, start + len(ids), dtype=torch.int64)
            tables = block_tables([cache.blocks] * len(ids))
        else:
            rows = torch.tensor([ids], dtype=torch.int64)
            starts = torch.tensor([start], dtype=torch.int64)
            tables = block_tables([cache.blocks])
        out = self.runner.forward(rows.to(self.runner.device), starts, tables)
        return out[-1]

    def _keep(self, cache: DraftCache, positions: int) -> None:
        """Keep the first `positions` (all valid) and forget the rest: its blocks go back."""
        cache.sure = positions
        cache.tail = []
        keep = blocks_for(positions)
        if len(cache.blocks) > keep:
            self.pool.free(cache.blocks[keep:])
            del cache.blocks[keep:]

    def _room(self, cache: DraftCache, positions: int) -> bool:
        """Blocks for `positions` K/V, dropping the least recently used other caches when
        the pool is out; False if even that is not enough."""
        need = blocks_for(positions) - len(cache.blocks)
        while need > self.pool.available and (self.donors or len(self.caches) > 1):
            if self.donors:
                self._drop_donor()
            else:
                self._drop(next(iter(self.caches)))
        if need > self.pool.available:
            return False
        cache.blocks += [self.pool.allocate() for _ in range(max(0, need))]
        return len(cache.blocks) * BLOCK_TOKENS >= positions

    def _drop(self, seq_id: int) -> None:
        cache = self.caches.pop(seq_id)
        self.pool.free(cache.blocks)

    def _drop_donor(self) -> None:
        _, donor = self.donors.popitem(last=False)
        self.pool.free(donor.blocks)


def vocabulary_mismatch(target: Seq[str], draft: Seq[str]) -> str | None:
    """Why a draft's vocabulary is not the target's (token for token), or None."""
    if len(target) != len(draft):
        return f"{len(draft)} tokens, the target has {len(target)}"
    for i, (a, b) in enumerate(zip(target, draft, strict=True)):
        if a != b:
            return f"token {i} is {b!r}, the target's is {a!r}"
    return None


def load_draft(
    path: str | Path,
    target_tokens: Seq[str],
    *,
    dtype: str,
    device: torch.device | str,
    context: int,
    names: tuple[str, str] = ("the target", "the draft"),
) -> DraftModel:
    """The draft model in `path` on `device`, its KV pool for `POOL_SEQUENCES` of `context`
    tokens. ConfigError naming both models (`names`: the target's, the draft's) when its
    vocabulary is not `target_tokens`, token for token."""
    with GGUFFile(path) as gguf:
        problem = vocabulary_mismatch(
            target_tokens, gguf.metadata.get("tokenizer.ggml.tokens") or []
        )
        if problem is not None:
            raise ConfigError(
                f"speculative draft {names[1]!r} cannot draft for {names[0]!r}: "
                f"its vocabulary differs ({problem})"
            )
        sizing = engine_sizing(
            gguf.config, dtype, device, kv_cache_mb=0, max_batch=POOL_SEQUENCES, context=context
        )
        model = load_transformer(gguf, dtype=dtype, device=torch.device(device))
    return DraftModel(SingleRunner(model, blocks=sizing.kv_blocks, context=sizing.context))
