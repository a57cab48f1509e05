"""The engine over a fake runner and tokenizer, for the engine tests: `FakeRunner` keeps the
token of every KV position in its block and picks the next token from the whole row read back
through the block table, so any scheduling or block-table slip changes the output;
`fake_engine` builds one, `run_alone` runs a prompt by itself to compare a batched run against."""

from __future__ import annotations

import torch

from neuron_trio.engine.block_pool import (
    BLOCK_TOKENS,
    NULL_BLOCK,
    RESERVED_BLOCKS,
    blocks_for,
)
from neuron_trio.engine.engine import Engine
from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.engine.types import SamplingParams
from tests.engine.drain import drain

PAD, BOS, EOS, END = 0, 1, 2, 3
SPECIAL = {PAD: b"<pad>", BOS: b"<s>", EOS: b"</s>", END: b"<|im_end|>"}
WORDS = [b" the", b" cat", b" sat", b" on", b" mat", b"ST", b"OP", b"\xc3", b"\xa9", b"!"]
VOCAB = 32  # ids past the words decode to single letters


def _piece(token_id: int) -> bytes:
    if token_id in SPECIAL:
        return SPECIAL[token_id]
    i = token_id - len(SPECIAL)
    return WORDS[i] if i < len(WORDS) else bytes([ord("a") + i - len(WORDS)])


TOKEN = {_piece(i).decode("latin-1"): i for i in range(VOCAB)}


class FakeTokenizer:
    """Byte pieces per id; enough of the real Tokenizer for the engine and the text pipeline."""

    bos_id = BOS
    eos_id = EOS
    add_bos = True
    chat_template = None
    vocab_size = VOCAB
    special_ids = frozenset(SPECIAL)
    strip_leading_space = False
    token_bytes = tuple(_piece(i) for i in range(VOCAB))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [TOKEN[" " + w] for w in text.split()]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        pieces = [_piece(i) for i in ids if not (skip_special_tokens and i in SPECIAL)]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return _piece(token_id).decode("utf-8", errors="replace")

    def token_to_id(self, text: str) -> int | None:
        return TOKEN.get(text)

    def id_to_token(self, token_id: int) -> str:
        return self.token_text(token_id)


def _default_rule(row: list[int]) -> int:
    """The next token as a function of the whole KV row: any scheduling slip changes it."""
    return len(SPECIAL) + (sum(row) * 31 + len(row) * 7) % (VOCAB - len(SPECIAL))


class FakeRunner:
    """Keeps the token of every KV position in its block; logits pick `rule(row)` of the row
    read back through the block table, so a wrong table, a block written by two rows or a
    gap before a row's start changes the output or trips an assertion."""

    def __init__(self, *, blocks: int = 22, context: int = 64, rule=_default_rule):
        self.config = LlamaConfig(
            n_layers=1, dim=8, n_heads=1, n_kv_heads=1, head_dim=8, ffn_dim=8,
            vocab_size=VOCAB, rope_base=1e4, rope_dim=8, rms_eps=1e-5,
            context_length=context, tied_output=True,
        )  # fmt: skip
        self.blocks = blocks
        self.context = context
        self.device = torch.device("cpu")
        self.dense_prefill_rows = None
        self.rule = rule
        self.store: dict[int, list[int | None]] = {}  # block -> the token at each position
        self.calls: list[tuple[int, int]] = []  # (B, T) of every forward
        self.longest = 0  # the furthest position + 1 ever written
        self.fail_next = False

    def read(self, table: list[int], length: int) -> list[int | None]:
        return [
            self.store.get(table[p // BLOCK_TOKENS], [None] * BLOCK_TOKENS)[p % BLOCK_TOKENS]
            for p in range(length)
        ]

    def forward(self, input_ids, start_pos, tables, *, lengths=None, all_logits=False):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected forward failure")
        batch, width = input_ids.shape
        assert tables.shape[0] == batch
        logits = torch.full((batch, VOCAB), -5.0)
        written: set[int] = set()
        for b in range(batch):
            table, start = tables[b].tolist(), int(start_pos[b])
            length = width if lengths is None else int(lengths[b])
            assert 1 <= length <= width
            # lengths come only with padded rows (some row shorter than the batch is wide)
            assert lengths is None or int(min(lengths)) < width
            end = start + length
            assert end <= self.context, "past the context"
            own = table[start // BLOCK_TOKENS : blocks_for(end)]  # the blocks it writes
            assert all(NULL_BLOCK < x < self.blocks for x in own), own  # never the null block
            assert not written & set(own), "two rows write one block"
            written |= set(own)
            prefix = self.read(table, start)
            assert None not in prefix, f"a gap before position {start}"
            new = [int(t) for t in input_ids[b, :length]]  # padding is not part of the row
            for i, token in enumerate(new):
                p = start + i
                block = self.store.setdefault(table[p // BLOCK_TOKENS], [None] * BLOCK_TOKENS)
                block[p % BLOCK_TOKENS] = token
            self.longest = max(self.longest, end)
            logits[b, self.rule(prefix + new)] = 5.0
        self.calls.append((batch, width))
        return logits

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        for s, d in zip(src, dst, strict=True):
            self.store[d] = list(self.store[s])


def fake_engine(
    *,
    max_batch: int = 4,
    context: int = 64,
    prefill_chunk: int = 4,
    rule=_default_rule,
    blocks: int | None = None,
    prefix_cache: bool = True,
):
    """An engine over a FakeRunner whose pool holds `blocks` usable blocks (default: enough for
    max_batch x context tokens)."""
    usable = max_batch * blocks_for(context) if blocks is None else blocks
    runner = FakeRunner(blocks=usable + RESERVED_BLOCKS, context=context, rule=rule)
    engine = Engine(
        runner,
        FakeTokenizer(),
        max_batch=max_batch,
        context=context,
        prefill_chunk=prefill_chunk,
        prefix_cache=prefix_cache,
    )
    return engine, runner


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def run_alone(prompt: list[int], params: SamplingParams) -> list[int]:
    engine, _ = fake_engine()
    seq_id = engine.add(prompt, params, chat=False)
    return [t for e in drain(engine)[seq_id] for t in e.token_ids]


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return [BOS] + [
        len(SPECIAL) + (seed * 5 + i * 3) % (VOCAB - len(SPECIAL)) for i in range(n - 1)
    ]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
