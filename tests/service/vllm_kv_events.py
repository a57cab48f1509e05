"""vLLM's KV events schema as a subscriber (llm-d's indexer) defines it, written from vLLM's
vllm/distributed/kv_events.py and its examples/online_serving/kv_events_subscriber.py,
independently of neuron's structs: msgspec Structs, array-like, tagged by class name, block
hashes as bytes or int. `DECODER` decodes a batch; `END_SEQ` is the replay's end marker."""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
