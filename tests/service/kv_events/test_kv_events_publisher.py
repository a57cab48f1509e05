"""KV events on a real ZeroMQ socket, decoded as a vLLM subscriber (llm-d's indexer) would.

The schema (tests/service/vllm_kv_events.py) is written from vLLM's, independently of neuron's
structs. A second decode with the plain `msgpack` package checks the raw arrays llm-d's Go
decoder reads field by field.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from neuron_trio.config import KvEventsConfig
from neuron_trio.engine.block_pool import BLOCK_TOKENS, block_key
from neuron_trio.engine.kv_events import KVEventLog
from neuron_trio.engine.types import SamplingParams
from neuron_trio.errors import ConfigError
from neuron_trio.service.kv_events.kv_events_publisher import (
    KVEventsCollector,
    KVEventsPublisher,
    is_bind_endpoint,
)
from tests.engine.drain import drain as _run
from tests.engine.fake_runner import fake_engine, prompt_ids
from tests.service.vllm_kv_events import (
    DECODER,
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
)

WAIT_S = 10.0  # the most any message may take to arrive (never a timing assertion)


class Recorder:
    """Stands for an engine: keeps the log the publisher hands it."""

    def __init__(self) -> None:
        self.log: KVEventLog | None = None

    def record_kv_events(self, log: KVEventLog | None) -> None:
        self.log = log


def _config(**overrides: Any) -> KvEventsConfig:
    base: dict[str, Any] = {
        "enabled": True,
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv@{host}@{model}",
    }
    return KvEventsConfig(**(base | overrides))


async def _recv(sock: zmq.Socket) -> list[bytes] | None:
    def poll() -> list[bytes] | None:
        if sock.poll(int(WAIT_S * 1000)):
            return sock.recv_multipart()
        return None

    return await trio.to_thread.run_sync(poll)


async def _subscribed(publisher: KVEventsPublisher, sub: zmq.Socket) -> None:
    """Until the subscription is through (ZeroMQ's slow joiner): a throwaway model's
    "all cleared" batches, until one arrives; then drop the ones still in flight."""
    probe = Recorder()
    publisher.attach("probe", probe)
    with trio.fail_after(WAIT_S):
        while not await trio.to_thread.run_sync(sub.poll, 100):
            assert probe.log is not None
            probe.log.cleared()
    publisher.detach("probe", probe)
    await trio.sleep(0.3)  # a few flushes: the probe's last batches go out
    while sub.poll(0):
        sub.recv_multipart()


def _run_with_subscriber(
    test: Callable[[KVEventsPublisher, zmq.Socket], Awaitable[None]], log_capacity: int = 1024
) -> None:
    async def main() -> None:
        publisher = KVEventsPublisher(_config(), hostname="node-1", log_capacity=log_capacity)
        context = zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(publisher.run)
                assert publisher.endpoint is not None
                sub.connect(publisher.endpoint)
                sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
                await _subscribed(publisher, sub)
                await test(publisher, sub)
                nursery.cancel_scope.cancel()
        finally:
            sub.close()

    trio.run(main)


def test_a_vllm_subscriber_decodes_a_real_engines_blocks() -> None:
    engine, _ = fake_engine(max_batch=2, context=64, prefill_chunk=64)
    prompt = prompt_ids(40)

    async def test(publisher: KVEventsPublisher, sub: zmq.Socket) -> None:
        publisher.attach("smollm2-135m", engine)
        engine.add(prompt, SamplingParams(temperature=0.0, max_tokens=2), chat=False)
        _run(engine)
        # attach's "all cleared" (anything known of this model here before is stale), then
        # the prompt's two full blocks as one chain: in one batch, or two if the publisher
        # drained between attach and the step
        events: list[Any] = []
        raw_events: list[Any] = []
        while len(events) < 2:
            frames = await _recv(sub)
            assert frames is not None
            topic, seq, payload = frames
            assert topic == b"kv@node-1@smollm2-135m"  # llm-d reads kv@<pod>@<model>
            assert len(seq) == 8
            batch = DECODER.decode(payload)
            assert batch.data_parallel_rank is None
            events.extend(batch.events)
            # The raw arrays, as llm-d's Go decoder reads them: [ts, [event, ...], dp_rank]
            raw = msgpack.unpackb(payload, raw=False)
            assert isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], float)
            assert raw[2] is None  # no data-parallel rank
            raw_events.extend(raw[1])
        cleared, stored = events
        assert isinstance(cleared, AllBlocksCleared)
        assert isinstance(stored, BlockStored)
        k0 = block_key(None, prompt[:BLOCK_TOKENS])
        k1 = block_key(k0, prompt[BLOCK_TOKENS : 2 * BLOCK_TOKENS])
        assert stored.block_hashes == [k0, k1]
        assert stored.parent_block_hash is None
        assert stored.token_ids == prompt[: 2 * BLOCK_TOKENS]
        assert stored.block_size == BLOCK_TOKENS == 16
        assert (stored.lora_id, stored.medium, stored.lora_name) == (None, None, None)
        # each raw event: [tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name]
        assert raw_events[0] == ["AllBlocksCleared"]
        assert raw_events[1] == [
            "BlockStored", [k0, k1], None, prompt[:32], 16, None, None, None,
        ]  # fmt: skip

    _run_with_subscriber(test)


def test_removals_resets_and_detach_follow_in_sequence_and_replay_resends_them() -> None:
    async def test(publisher: KVEventsPublisher, sub: zmq.Socket) -> None:
        engine = Recorder()
        publisher.attach("m", engine)
        log = engine.log
        assert log is not None
        a = block_key(None, [1] * BLOCK_TOKENS)
        b = block_key(a, [2] * BLOCK_TOKENS)
        c = block_key(None, [3] * BLOCK_TOKENS)
        log.stored(a, None, [1] * BLOCK_TOKENS)
        log.stored(b, a, [2] * BLOCK_TOKENS)
        log.stored(c, None, [3] * BLOCK_TOKENS)
        log.removed(b)
        log.removed(c)
        received: list[list[bytes]] = []
        events: list[Any] = []
        with trio.fail_after(WAIT_S):
            while len(events) < 4:
                frames = await _recv(sub)
                assert frames is not None
                received.append(frames)
                events += DECODER.decode(frames[2]).events
        assert [type(e).__name__ for e in events] == [
            "AllBlocksCleared", "BlockStored", "BlockStored", "BlockRemoved",
        ]  # fmt: skip
        assert events[1].block_hashes == [a, b] and events[1].parent_block_hash is None
        assert events[2].block_hashes == [c] and events[2].parent_block_hash is None
        assert events[3].block_hashes == [b, c]
        publisher.detach("m", engine)
        assert engine.log is None  # the engine records no more
        frames = await _recv(sub)
        assert frames is not None
        received.append(frames)
        assert DECODER.decode(frames[2]).events == [AllBlocksCleared()]
        seqs = [int.from_bytes(f[1], "big") for f in received]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

        # A subscriber that missed them asks the replay socket from the first one on.
        assert publisher.replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(publisher.replay_endpoint)
            dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
            replayed: list[list[bytes]] = []
            with trio.fail_after(WAIT_S):
                while True:
                    frames = await _recv(dealer)
                    assert frames is not None
                    assert frames[0] == b""
                    if frames[1] == END_SEQ:
                        assert frames[2] == b""
                        break
                    replayed.append(frames[1:])
            assert replayed == [f[1:] for f in received]
            # A malformed request is ignored (no reply, no harm); the socket still serves.
            dealer.send_multipart([b"", b"not eight bytes"])
            dealer.send_multipart([b"", (seqs[-1]).to_bytes(8, "big")])
            frames = await _recv(dealer)
            assert frames == [b"", *received[-1][1:]]
            assert (await _recv(dealer)) == [b"", END_SEQ, b""]
            stats = publisher.statistics()
            assert (stats.replays, stats.bad_replays) == (2, 1)
        finally:
            dealer.close()

    _run_with_subscriber(test)


def test_a_log_that_overflows_sends_all_cleared_and_counts_the_loss() -> None:
    async def test(publisher: KVEventsPublisher, sub: zmq.Socket) -> None:
        engine = Recorder()
        publisher.attach("m", engine)
        assert engine.log is not None
        # 40 records into a log of 8 between two flushes (50 ms apart; this takes µs): it
        # overflows whichever flush falls in between
        for i in range(40):
            engine.log.stored(block_key(None, [i] * BLOCK_TOKENS), None, [i] * BLOCK_TOKENS)
        events: list[Any] = []
        with trio.fail_after(WAIT_S):
            while publisher.statistics().dropped == 0 or not events:
                frames = await _recv(sub)
                assert frames is not None
                events += DECODER.decode(frames[2]).events
        assert any(isinstance(e, AllBlocksCleared) for e in events)
        assert sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)) < 40
        registry = CollectorRegistry()
        registry.register(KVEventsCollector(publisher))
        text = generate_latest(registry).decode()
        dropped = publisher.statistics().dropped
        assert dropped > 0 and f"neuron_kv_events_dropped_total {float(dropped)}" in text
        assert "neuron_kv_events_batches_total" in text

    _run_with_subscriber(test, log_capacity=8)


def test_connects_when_the_endpoint_is_not_a_wildcard() -> None:
    """vLLM's rule: `tcp://host:port` is connected to (a central indexer binds); a loopback
    IP address is bound, so a local indexer is reached by name."""

    async def main() -> None:
        context = zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        publisher = KVEventsPublisher(
            _config(endpoint=f"tcp://localhost:{port}", replay_endpoint=""), hostname="h"
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(publisher.run)
                assert publisher.endpoint == f"tcp://localhost:{port}"
                assert publisher.replay_endpoint is None
                await _subscribed(publisher, sub)
                nursery.cancel_scope.cancel()
        finally:
            sub.close()

    trio.run(main)


def test_a_replay_address_in_use_is_an_os_error_naming_the_key() -> None:
    async def main() -> None:
        holder = zmq.Context.instance().socket(zmq.ROUTER)
        holder.setsockopt(zmq.LINGER, 0)
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        taken = f"tcp://127.0.0.1:{port}"
        publisher = KVEventsPublisher(_config(replay_endpoint=taken), hostname="h")
        try:
            with (
                trio.fail_after(WAIT_S),
                pytest.raises(OSError, match=rf"kv_events\.replay_endpoint {taken}: "),
            ):
                await publisher.run()
        finally:
            holder.close()

    trio.run(main)


def test_an_endpoint_that_cannot_be_bound_is_an_os_error_naming_the_key(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/no-such-directory/events.sock"
    publisher = KVEventsPublisher(_config(endpoint=endpoint), hostname="h")

    async def main() -> None:
        with trio.fail_after(WAIT_S):
            await publisher.run()

    with pytest.raises(OSError, match=rf"kv_events\.endpoint {endpoint}: "):
        trio.run(main)


def test_without_pyzmq_enabling_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq raises ImportError
    publisher = KVEventsPublisher(_config(), hostname="h")
    with pytest.raises(ConfigError, match=r"kv_events\.enabled: needs pyzmq"):
        trio.run(publisher.run)


def test_the_default_endpoint_is_bound_on_loopback() -> None:
    """Issue 47: the default binds 127.0.0.1 (a loopback IP address is bound, not connected
    to), where `tcp://*:5557` bound every interface."""
    assert KvEventsConfig().endpoint == "tcp://127.0.0.1:5557"
    assert is_bind_endpoint("tcp://127.0.0.1:5557") and is_bind_endpoint("tcp://[::1]:5557")
    assert not is_bind_endpoint("tcp://localhost:5557")
    assert not is_bind_endpoint("tcp://indexer.example:5557")
