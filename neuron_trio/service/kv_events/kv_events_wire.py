"""vLLM's KV-events wire schema, and neuron's event records turned into it.

msgspec Structs, array-like, tagged by class name, field for field as vLLM's
(vllm/distributed/kv_events.py) in the layout llm-d's indexer decodes:

    EventBatch       [ts, events, data_parallel_rank]
    BlockStored      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                      lora_id, medium, lora_name]
    BlockRemoved     ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared ["AllBlocksCleared"]

(array-like Structs write every field, defaults included, so the batch's rank is a nil.) A
block hash is the block's 16-byte prefix-cache key (vLLM's hashes are bytes too; llm-d takes
their last 8 bytes). A BlockStored covers a chain of blocks, each the parent of the next, with
their tokens concatenated, as vLLM sends a request's new blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from neuron_trio.executor.api import (
    BLOCK_TOKENS,
    AllClearedRecord,
    BlockRemovedRecord,
    BlockStoredRecord,
    KVEventRecord,
)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The tag is the class name, as in vLLM."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def wire_events(
    records: Iterable[KVEventRecord],
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """`records` as vLLM's events: runs of chained stores, and of removals, joined into one."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    last_key: bytes | None = None  # of the last block of a BlockStored at the end of `events`
    for record in records:
        last = events[-1] if events else None
        if isinstance(record, BlockStoredRecord):
            if (
                isinstance(last, BlockStored)
                and record.parent is not None
                and record.parent == last_key
            ):
                last.block_hashes.append(record.key)
                last.token_ids.extend(record.tokens)
            else:
                events.append(
                    BlockStored(
                        block_hashes=[record.key],
                        parent_block_hash=record.parent,
                        token_ids=list(record.tokens),
                        block_size=BLOCK_TOKENS,
                        lora_id=None,
                        medium=None,
                        lora_name=None,
                    )
                )
            last_key = record.key
        elif isinstance(record, BlockRemovedRecord):
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(record.key)
            else:
                events.append(BlockRemoved(block_hashes=[record.key], medium=None))
        elif isinstance(record, AllClearedRecord):
            events.append(AllBlocksCleared())
    return events
