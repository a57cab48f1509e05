"""Publish the prefix cache's changes in vLLM's KV-events format, for a KV-aware router.

llm-d's indexer (and any consumer written for vLLM) subscribes to a ZeroMQ PUB socket and
reads, per message, three frames: the topic (`kv@<pod>@<model>` for llm-d), an 8-byte
big-endian sequence number, and a msgpack `EventBatch`. Like vLLM's `ZmqEventPublisher`
(vllm/distributed/kv_events.py), a ROUTER socket replays missed batches: a subscriber that
sees a gap sends `[b"", start_seq (8 bytes, big-endian)]` and gets back every batch kept from
that number on, each as `[b"", seq, payload]`, then `[b"", -1 (8 bytes, signed), b""]`.

The wire schema is vLLM's (`kv_events_wire.py`).

Threads: the engine records into a `KVEventLog` per model (engine/kv_events.py); the publisher
drains the logs every FLUSH_INTERVAL_S on a thread of its own, which alone touches the
sockets (ZeroMQ sockets are not thread-safe) and never blocks on a slow subscriber: PUB drops
past its high-water mark, replies to replays are sent without waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import trio
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from neuron_trio.config import KvEventsConfig, is_loopback_host
from neuron_trio.errors import ConfigError
from neuron_trio.executor.api import DEFAULT_CAPACITY, KVEventLog
from neuron_trio.service.kv_events.kv_events_wire import KVEventBatch, wire_events

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.05  # how often the logs are drained (a step is ~10-100 ms)
REPLAY_BUFFER_BYTES = 64 << 20  # batches kept for replay: at most this much msgpack
REPLAYS_PER_TICK = 8  # replay requests answered between two flushes
PUB_HWM = 100_000  # messages queued per subscriber before PUB drops (vLLM's default)
LINGER_MS = 500  # at close, how long queued messages (the last "all cleared") may take
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- the publisher ---------------------------------------------------------------------------


class KVEventsSource(Protocol):
    """What the publisher needs of a model's engine (`engine.Engine`, `ServingEngine`)."""

    def record_kv_events(self, log: KVEventLog | None) -> None: ...


@dataclass
class _Source:
    topic: bytes
    log: KVEventLog
    dropped_seen: int = 0  # of log.statistics().dropped, already counted


@dataclass(frozen=True)
class KVEventsPublisherStatistics:
    batches: int  # sent on the PUB socket
    events: int
    dropped: int  # records lost because a log overflowed (each time: an "all cleared")
    send_errors: int
    replays: int  # replay requests answered
    bad_replays: int  # malformed replay requests ignored


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local transport is bound, anything else connected to; and
    a loopback IP address is bound too, so that the default (tcp://127.0.0.1:5557) publishes
    on this machine only (issue 47: `tcp://*` reached every interface, unauthenticated). A
    local indexer that binds is reached as tcp://localhost:PORT."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
        or (endpoint.startswith("tcp://") and host != "localhost" and is_loopback_host(host))
    )


class KVEventsPublisher:
    """The PUB (and replay ROUTER) sockets and the thread that feeds them.

    Usage: `await nursery.start(publisher.run)` (binds or connects; OSError if it cannot),
    then `attach(model, engine)` once a model serves and `detach(model)` once it is gone.
    """

    def __init__(
        self,
        config: KvEventsConfig,
        *,
        hostname: str,
        context: Any = None,
        log_capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self.config = config
        self.hostname = hostname
        self.log_capacity = log_capacity  # of each model's KVEventLog
        self._context = context
        self._lock = threading.Lock()  # guards _sources and _retired
        self._sources: dict[str, _Source] = {}
        self._retired: list[_Source] = []  # detached: their last records, then dropped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pub: Any = None
        self._replay: Any = None
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_bytes = 0
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._batches = 0
        self._events = 0
        self._dropped = 0
        self._send_errors = 0
        self._replays = 0
        self._bad_replays = 0
        self.endpoint: str | None = None  # as bound (a "*" port resolved), or connected to
        self.replay_endpoint: str | None = None

    # ---- the node's side (trio thread) ------------------------------------------------------

    def topic_for(self, model: str) -> bytes:
        return self.config.topic.format(host=self.hostname, model=model).encode()

    def attach(self, model: str, engine: KVEventsSource) -> None:
        """Publish `model`'s cache changes from now on, starting with an "all cleared" (what
        a subscriber knew of this model here before is stale: a new process, a new load)."""
        event_log = KVEventLog(self.log_capacity)
        event_log.cleared()
        with self._lock:
            self._sources[model] = _Source(self.topic_for(model), event_log)
        engine.record_kv_events(event_log)

    def detach(self, model: str, engine: KVEventsSource | None = None) -> None:
        """`model` is gone: its last events and an "all cleared" go out at the next flush."""
        if engine is not None:
            engine.record_kv_events(None)
        with self._lock:
            source = self._sources.pop(model, None)
            if source is None:
                return
            source.log.cleared()
            self._retired.append(source)

    def statistics(self) -> KVEventsPublisherStatistics:
        return KVEventsPublisherStatistics(
            batches=self._batches,
            events=self._events,
            dropped=self._dropped,
            send_errors=self._send_errors,
            replays=self._replays,
            bad_replays=self._bad_replays,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the sockets, start the thread, report started; on cancellation, flush what is
        left (detached models' "all cleared" included) and close.

        Raises OSError naming the key if a socket cannot be bound or connected, ConfigError if
        pyzmq is missing.
        Cancellation handling: the thread is told to stop and waited for (it wakes every
        FLUSH_INTERVAL_S; its last send waits at most LINGER_MS), shielded, so the sockets
        are always closed.
        """
        self._open()
        self._thread = threading.Thread(target=self._loop, name="neuron-kv-events", daemon=True)
        self._thread.start()
        mode = "bound" if is_bind_endpoint(self.config.endpoint) else "connected"
        log.info(
            "kv events: publishing on %s (%s)%s, topic %r",
            self.endpoint,
            mode,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
            self.config.topic,
        )
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            self._stop.set()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._thread.join)

    # ---- the publisher's thread -------------------------------------------------------------

    def _open(self) -> None:
        try:
            import zmq  # only when enabled: the daemon starts without it otherwise
        except ImportError as exc:
            raise ConfigError(f"kv_events.enabled: needs pyzmq, which is missing ({exc})") from None

        context = self._context if self._context is not None else zmq.Context.instance()
        endpoint = self.config.endpoint
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        pub.setsockopt(zmq.LINGER, LINGER_MS)
        try:
            if is_bind_endpoint(endpoint):
                pub.bind(endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
                self.endpoint = endpoint
        except zmq.ZMQError as exc:
            pub.close(linger=0)
            raise OSError(f"kv_events.endpoint {endpoint}: {exc}") from None
        replay = None
        if self.config.replay_endpoint:
            replay = context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            try:
                replay.bind(self.config.replay_endpoint)
            except zmq.ZMQError as exc:
                pub.close(linger=0)
                replay.close(linger=0)
                raise OSError(
                    f"kv_events.replay_endpoint {self.config.replay_endpoint}: {exc}"
                ) from None
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub, self._replay = pub, replay

    def _loop(self) -> None:
        import zmq

        try:
            while True:
                stopping = self._stop.is_set()
                self._flush()
                if stopping:
                    return
                if self._replay is None:
                    self._stop.wait(FLUSH_INTERVAL_S)
                    continue
                if self._replay.poll(int(FLUSH_INTERVAL_S * 1000), zmq.POLLIN):
                    for _ in range(REPLAYS_PER_TICK):
                        self._serve_replay()
                        if not self._replay.poll(0, zmq.POLLIN):
                            break
        except Exception:
            log.exception("kv events: the publisher thread failed; events are no longer sent")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _flush(self) -> None:
        with self._lock:
            # A model unloaded and loaded again: the old load's last records go first.
            sources = [*self._retired, *self._sources.values()]
            self._retired.clear()
        for source in sources:
            records = source.log.drain()
            # Counted before the batch goes out: whoever has received its "all cleared" then
            # also sees the loss in the statistics (counted after, a subscriber could read
            # the batch and still find dropped == 0).
            dropped = source.log.statistics().dropped
            if dropped > source.dropped_seen:
                self._dropped += dropped - source.dropped_seen
                log.warning(
                    "kv events: %s: %d events dropped (not drained in time); an 'all cleared'"
                    " goes out instead",
                    source.topic.decode(errors="replace"),
                    dropped - source.dropped_seen,
                )
                source.dropped_seen = dropped
            if records:
                self._send(source.topic, wire_events(records))

    def _send(self, topic: bytes, events: list[Any]) -> None:
        import zmq

        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # A PUB socket drops rather than blocks; an error here is rare (and the replay
            # buffer below still has the batch).
            self._send_errors += 1
            log.warning("kv events: batch %d not sent: %s", seq, exc)
        self._batches += 1
        self._events += len(events)
        self._buffer.append((seq, payload))
        self._buffer_bytes += len(payload)
        while len(self._buffer) > self.config.replay_batches or (
            self._buffer_bytes > REPLAY_BUFFER_BYTES and len(self._buffer) > 1
        ):
            _, dropped = self._buffer.popleft()
            self._buffer_bytes -= len(dropped)

    def _serve_replay(self) -> None:
        import zmq

        try:
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        # [identity, b"", start_seq]: anything else is ignored (a subscriber's bug or a probe).
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self._bad_replays += 1
            log.debug("kv events: malformed replay request of %d frames ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        self._replays += 1
        try:
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart(
                        (client, b"", seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                    )
            self._replay.send_multipart((client, b"", END_SEQ, b""), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client went, or its queue is full: it asks again
            log.debug("kv events: replay to a subscriber cut short: %s", exc)


class KVEventsCollector(Collector):
    """`/metrics` for the publisher: `registry.register(KVEventsCollector(publisher))`."""

    def __init__(self, publisher: KVEventsPublisher) -> None:
        self._publisher = publisher

    def describe(self) -> Iterable[Metric]:
        return []  # read at scrape time

    def collect(self) -> Iterator[Metric]:
        s = self._publisher.statistics()
        for name, text, value in (
            ("batches", "KV event batches published ([kv_events])", s.batches),
            ("events", "KV events published (a BlockStored covers a chain of blocks)", s.events),
            ("dropped", "KV events lost to a full log (an 'all cleared' went instead)", s.dropped),
            ("send_errors", "KV event batches the PUB socket refused", s.send_errors),
            ("replays", "Replay requests answered", s.replays),
        ):
            family = CounterMetricFamily(f"neuron_kv_events_{name}", text)
            family.add_metric([], float(value))
            yield family
