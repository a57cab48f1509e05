"""The parts of an engine step alone: the batch tensors (`engine/batch.py`) and the
stop-token rule (`engine/finish.py`), without a model (prompt preparation: test_prompt.py)."""

from __future__ import annotations

from typing import Any

import torch

from neuron_trio.engine.batch import block_tables, decode_inputs, prefill_inputs, sampled_rows
from neuron_trio.engine.block_pool import NULL_BLOCK
from neuron_trio.engine.finish import is_stop_token
from neuron_trio.engine.scheduler import PrefillChunk, StepPlan
from neuron_trio.engine.sequence import Sequence, SequenceStatus
from neuron_trio.engine.types import SamplingParams

CPU = torch.device("cpu")


def _seq(seq_id: int, prompt: list[int], blocks: list[int], **params: Any) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams(**params))
    seq.blocks = blocks
    return seq


def test_prefill_rows_are_padded_to_the_longest_and_tables_with_the_null_block() -> None:
    a, b = _seq(1, [1, 2, 3], [2]), _seq(2, [4], [3, 4])
    at = prefill_inputs([PrefillChunk(a, 0, 3), PrefillChunk(b, 0, 1)], CPU)
    assert at.ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert at.lengths is not None and at.lengths.tolist() == [3, 1]
    assert at.tables.tolist() == [[2, NULL_BLOCK], [3, 4]]
    same = prefill_inputs([PrefillChunk(a, 0, 3)], CPU)
    assert same.lengths is None  # nothing padded
    assert block_tables([[7], [8, 9]]).tolist() == [[7, NULL_BLOCK], [8, 9]]


def test_decode_rows_feed_their_last_token_and_forks_sample_after_their_parent() -> None:
    a = _seq(1, [1, 2], [2])
    a.status, a.prefilled, a.output_ids = SequenceStatus.DECODING, 2, [9]
    at = decode_inputs([a], CPU)
    assert at.ids.tolist() == [[9]] and at.start_pos.tolist() == [a.decode_pos]
    b, fork = _seq(2, [3, 4], [3]), _seq(3, [3, 4], [])
    b.forks = [fork]
    plan = StepPlan(decode=[a], prefill=[PrefillChunk(b, 0, 2)])
    assert sampled_rows(plan) == [a, b, fork]


def test_stop_tokens_end_of_turn_for_chats_end_of_text_for_completions() -> None:
    chat, raw = _seq(1, [1], []), _seq(2, [1], [])
    chat.chat = True
    ids = {"end_of_turn_ids": {7, 2}, "eos_ids": {2}}
    assert is_stop_token(chat, 7, **ids) and not is_stop_token(raw, 7, **ids)
    assert is_stop_token(raw, 2, **ids)
    assert not is_stop_token(_seq(3, [1], [], ignore_eos=True), 2, **ids)
    assert is_stop_token(_seq(4, [1], [], ignore_eos=True, stop_token_ids=(5,)), 5, **ids)
