"""The model actor with a fake executor: queueing, admission, disconnects, unload, wedges.

No real threads and no sleeps: steps run through the real Watchdog with a trio-native thread
runner (`FakeThreads`) that the test can hold, and time is a MockClock moved by hand.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import generate_latest

from neuron_trio.engine.types import SamplingParams, SequenceEvent
from neuron_trio.errors import (
    ContextLengthError,
    ModelLoadError,
    QueueFullError,
    RequestError,
    UnavailableError,
)
from neuron_trio.service.api import ChatMessage, GenerationJob
from neuron_trio.service.model_actor import ModelActor
from neuron_trio.service.requests.event_stream import EventStream, merge_events

from .actor_harness import (
    PROBE_INTERVAL,
    STEP_TIMEOUT,
    Harness,
    job,
    run_actor,
    settle,
    spec,
)
from .fakes import FakeExecutor


def test_a_request_streams_its_events_to_the_end() -> None:
    async def test(h: Harness) -> None:
        assert h.actor.state == "serving" and h.executor.probes == 1  # warmed up
        r = h.consume(job(max_tokens=3))
        await settle()
        assert r["done"] and r["error"] is None
        assert [e.text for e in r["events"]] == ["x", "x", "x"]
        assert r["events"][-1].finish_reason == "length"
        assert h.engine.added == [[ord("h"), ord("i")]]
        assert h.actor.idle and h.engine.free_slots == 2
        assert h.metric("neuron_model_requests_total", outcome="length") == 1
        assert h.metric("neuron_model_generated_tokens_total") == 3
        assert h.metric("neuron_model_prompt_tokens_total") == 2
        assert h.metric("neuron_model_time_to_first_token_seconds_count") == 1
        assert h.metric("neuron_model_time_per_output_token_seconds_count") == 1
        text = generate_latest(h.registry).decode()
        assert 'neuron_model_queue_depth{model="m"} 0.0' in text
        assert 'neuron_model_state{model="m",state="serving"} 1.0' in text

    run_actor(test)


def test_each_request_is_checked_once_and_added_as_prepared() -> None:
    # The prompt is prepared (templated, tokenized, checked) on arrival; the engine's add
    # takes that PreparedPrompt (the fake refuses anything else) and checks nothing again.
    async def test(h: Harness) -> None:
        results = [h.consume(job(max_tokens=2)) for _ in range(3)]
        await settle()
        assert all(r["done"] and r["error"] is None for r in results)
        assert h.engine.prepared == 3 and len(h.engine.added) == 3

    run_actor(test)


def test_a_request_prepared_while_the_model_unloads_is_refused_not_queued() -> None:
    # The state is checked once, where the request queues: one whose prompt was still being
    # prepared when the unload began gets its 503 instead of joining a queue no loop serves.
    async def test(h: Harness) -> None:
        prepare = h.engine.prepare

        def prepare_during_unload(*args: object, **kw: object) -> object:
            h.actor._stopping = True  # as `unload()` sets it while the prompt is prepared
            return prepare(*args, **kw)  # type: ignore[arg-type]

        h.engine.prepare = prepare_during_unload  # type: ignore[method-assign]
        with pytest.raises(UnavailableError, match="unloading"):
            async with h.actor.generate(job(max_tokens=2)):
                pass
        assert h.engine.prepared == 1 and h.actor.queued == 0 and h.engine.added == []
        assert h.metric("neuron_model_requests_total", outcome="rejected_unavailable") == 1

    run_actor(test)


def test_chat_messages_go_through_the_template() -> None:
    async def test(h: Harness) -> None:
        messages = (ChatMessage("system", "s"), ChatMessage("user", "u"))
        r = h.consume(
            GenerationJob(model="m", params=SamplingParams(max_tokens=1), messages=messages)
        )
        # The template renders on a real worker thread (a task waiting for it counts as
        # blocked): wait for the request to be added, a thread round trip at a time.
        for _ in range(2000):
            await settle()
            if h.engine.added:
                break
            await trio.to_thread.run_sync(time.sleep, 0.001)
        await settle()
        assert r["error"] is None
        assert "".join(map(chr, h.engine.added[0])) == "<system>s<user>u<assistant>"

    run_actor(test)


def test_a_default_max_tokens_past_the_engines_context_is_cut_to_it() -> None:
    # Configured: context 4096 and default_max_tokens 1000; the engine's effective context is
    # 64 (the fake's; a model's own context caps the configured one the same way). The
    # default is cut to what the engine leaves after the prompt, not to the configured
    # context: 1000 failed in the engine's add, after queueing.
    async def test(h: Harness) -> None:
        assert h.actor.context == 64
        r = h.consume(GenerationJob(model="m", params=SamplingParams(max_tokens=None), prompt="hi"))
        await settle()
        assert r["error"] is None and r["done"]
        assert len(r["events"]) == 62  # to the end of the engine's context
        assert h.actor.info().context == 64

    run_actor(test, context=4096, default_max_tokens=1000)


def test_bad_requests_are_refused_before_queueing() -> None:
    async def test(h: Harness) -> None:
        with pytest.raises(ContextLengthError):
            async with h.actor.generate(job(max_tokens=100)):
                pass
        with pytest.raises(RequestError, match="empty"):
            async with h.actor.generate(job(prompt="")):
                pass
        assert h.engine.added == [] and h.actor.queued == 0
        assert h.metric("neuron_model_requests_total", outcome="rejected_invalid") == 2

    run_actor(test)


def test_every_chat_renders_off_the_event_loop_and_far_too_long_is_refused_first() -> None:
    async def test(h: Harness) -> None:
        def chat(n: int, content: str = "") -> GenerationJob:
            messages = tuple(ChatMessage("user", content) for _ in range(n))
            return GenerationJob(model="m", params=SamplingParams(max_tokens=1), messages=messages)

        with pytest.raises(ContextLengthError):  # rendered, then too long for context 64
            async with h.actor.generate(chat(2000)):
                pass
        async with h.actor.generate(chat(2)):
            pass
        # A chat template is the model file's code: every chat renders on a worker thread.
        assert h.engine.rendered_on == [False, False]
        # Beyond context x 64 characters: refused before the template ever runs.
        huge = "y" * (4096 * 64 + 1)
        with pytest.raises(ContextLengthError, match="characters") as err:
            async with h.actor.generate(chat(1, huge)):
                pass
        assert err.value.param == "messages"
        assert h.engine.rendered_on == [False, False]

    run_actor(test)


def test_queue_full_beyond_busy_slots_and_max_queue() -> None:
    async def test(h: Harness) -> None:
        h.threads.hold()  # the first step blocks: slots stay busy
        running = [h.consume(job(prompt=f"r{i}")) for i in range(2)]
        await settle()
        assert h.actor.running == 2 and h.actor.queued == 0
        queued = [h.consume(job(prompt=f"q{i}")) for i in range(2)]
        await settle()
        assert h.actor.queued == 2
        with pytest.raises(QueueFullError) as info:
            async with h.actor.generate(job(prompt="late")):
                pass
        assert info.value.status == 429 and info.value.retry_after_s >= 1
        assert h.metric("neuron_model_requests_total", outcome="rejected_queue_full") == 1
        h.threads.release()
        await settle()
        assert all(r["done"] and r["error"] is None for r in running + queued)
        assert h.actor.idle

    run_actor(test, max_batch=2, max_queue=2)


def test_waiting_requests_fill_free_slots_before_the_queue() -> None:
    async def test(h: Harness) -> None:
        # Before the loop admits anything, two requests take the two free slots' places and
        # one waits in a queue of one; the fourth is refused.
        h.threads.hold()
        async with h.actor.generate(job()), h.actor.generate(job()), h.actor.generate(job()):
            assert h.actor.queued == 3
            with pytest.raises(QueueFullError):
                async with h.actor.generate(job()):
                    pass
        h.threads.release()

    run_actor(test, max_batch=2, max_queue=1)


def test_admission_is_first_come_first_served() -> None:
    async def test(h: Harness) -> None:
        h.threads.hold()
        first = h.consume(job(prompt="a", max_tokens=1))
        await settle()
        later = []
        for p in "bcd":
            later.append(h.consume(job(prompt=p, max_tokens=1)))
            await settle()
        assert h.actor.queued == 3
        h.threads.release()
        await settle()
        assert [chr(ids[0]) for ids in h.engine.added] == ["a", "b", "c", "d"]
        assert all(r["done"] for r in [first, *later])

    run_actor(test, max_batch=1, max_queue=5)


def test_a_burst_from_idle_starts_in_one_step() -> None:
    """Requests that arrive within BURST_GAP_S of each other, from idle, are admitted
    together: the first waits for the others instead of stepping alone."""

    async def test(h: Harness) -> None:
        records = [h.consume(job(prompt="a", max_tokens=1))]
        await settle()
        assert h.engine.added == []  # waiting for the burst to settle
        for p in "bc":
            h.clock.jump(0.0008)  # each within the gap of the one before
            records.append(h.consume(job(prompt=p, max_tokens=1)))
            await settle()
        assert h.engine.added == []
        h.clock.jump(0.0011)  # the gap passes with no new arrival
        await settle()
        assert [chr(ids[0]) for ids in h.engine.added] == ["a", "b", "c"]
        assert h.engine.batches[0] == 3  # one step for the three
        assert all(r["done"] and r["error"] is None for r in records)

    run_actor(test, max_batch=4, max_queue=4, burst_gap_s=0.001)


def test_the_burst_wait_ends_at_its_window_or_a_full_batch() -> None:
    async def test(h: Harness) -> None:
        # arrivals every 0.9 ms keep it waiting, but no longer than 5 ms in all
        for i, p in enumerate("abcdef"):  # at 0, 0.9, .. 4.5 ms
            if i:
                h.clock.jump(0.0009)
            h.consume(job(prompt=p, max_tokens=1))
            await settle()
        assert h.engine.added == []  # at 4.5 ms: within the window and the gap
        h.clock.jump(0.0006)  # 5.1 ms: the window is over, the gap (to 5.5 ms) is not
        await settle()
        assert len(h.engine.added) == 6 and h.engine.batches == [6]
        # a full batch steps at once, without waiting for the gap
        for p in "ghijklmn":
            h.consume(job(prompt=p, max_tokens=1))
        await settle()
        assert len(h.engine.added) == 14 and h.engine.batches == [6, 8]

    run_actor(test, max_batch=8, max_queue=8, burst_gap_s=0.001)


def test_a_consumer_that_leaves_frees_its_slot_at_the_next_step() -> None:
    async def test(h: Harness) -> None:
        h.threads.hold()
        leaver = h.consume(job(prompt="a", max_tokens=50), leave_after=1)
        await settle()
        waiter = h.consume(job(prompt="b", max_tokens=2))
        await settle()
        assert h.actor.running == 1 and h.actor.queued == 1
        h.threads.release()
        await settle()
        assert leaver["done"] and len(leaver["events"]) == 1
        assert h.engine.cancelled == [1]
        assert waiter["done"] and waiter["error"] is None and len(waiter["events"]) == 2
        assert h.actor.idle and h.engine.free_slots == 1
        assert h.actor.info().slots_in_use == 0
        assert h.metric("neuron_model_kv_slots_in_use") == 0
        assert h.metric("neuron_model_requests_total", outcome="cancelled") == 1

    run_actor(test, max_batch=1, max_queue=5)


def test_a_lone_consumer_that_leaves_shows_its_slot_free() -> None:
    async def test(h: Harness) -> None:
        r = h.consume(job(max_tokens=50), leave_after=1)
        await settle()
        assert r["done"] and h.engine.cancelled == [1] and not h.engine.has_work
        assert h.actor.info().slots_in_use == 0 and h.actor.idle

    run_actor(test)


def test_a_queued_consumer_that_leaves_is_never_admitted() -> None:
    async def test(h: Harness) -> None:
        h.threads.hold()
        h.consume(job(prompt="a", max_tokens=1))
        await settle()
        with trio.CancelScope() as scope:  # the client goes away while queued
            async with h.actor.generate(job(prompt="b")):
                assert h.actor.queued == 1
                scope.cancel()
                await trio.sleep_forever()
        assert h.actor.queued == 0
        h.threads.release()
        await settle()
        assert [chr(ids[0]) for ids in h.engine.added] == ["a"]

    run_actor(test, max_batch=1, max_queue=5)


def test_unload_waits_for_in_flight_requests_then_closes() -> None:
    async def test(h: Harness) -> None:
        h.threads.hold()
        running = h.consume(job(max_tokens=2))
        queued = h.consume(job(max_tokens=2))
        await settle()
        unloaded = trio.Event()

        async def unload() -> None:
            await h.actor.unload()
            unloaded.set()

        h.nursery.start_soon(unload)
        await settle()
        assert not unloaded.is_set() and not h.executor.closed
        with pytest.raises(UnavailableError, match="unloading"):
            async with h.actor.generate(job()):
                pass
        h.threads.release()
        await unloaded.wait()
        assert running["error"] is None and len(running["events"]) == 2
        assert queued["error"] is None and len(queued["events"]) == 2
        assert h.executor.closed and h.actor.state == "unloaded"

    run_actor(test, max_batch=1, max_queue=5)


def test_a_wedged_step_fails_in_flight_requests_then_recovers() -> None:
    async def test(h: Harness) -> None:
        h.threads.hold()
        running = h.consume(job(max_tokens=5))
        queued = h.consume(job(max_tokens=5))
        await settle()
        h.clock.jump(STEP_TIMEOUT)  # the step runs past its deadline
        await settle()
        assert h.actor.state == "recovering"
        for r in (running, queued):
            assert isinstance(r["error"], UnavailableError) and r["error"].status == 503
        with pytest.raises(UnavailableError, match="recovering") as info:
            async with h.actor.generate(job()):
                pass
        assert info.value.retry_after_s > 0
        h.threads.release()  # the wedged step comes back within the abort deadline
        await settle()
        assert h.actor.state == "serving"
        assert h.engine.free_slots == 1
        again = h.consume(job(max_tokens=2))
        await settle()
        assert again["error"] is None and len(again["events"]) == 2
        assert h.metric("neuron_model_requests_total", outcome="unavailable") == 2

    run_actor(test, max_batch=1, max_queue=5)


def test_a_failed_step_fails_in_flight_requests_and_serves_again() -> None:
    async def test(h: Harness) -> None:
        h.executor.fail_next_step = RuntimeError("CUDA error: an illegal memory access")
        r = h.consume(job(max_tokens=2))
        await settle()
        assert isinstance(r["error"], UnavailableError)
        assert h.actor.state == "serving" and h.engine.free_slots == 2
        assert h.actor.info().last_error.startswith("RuntimeError")
        assert h.executor.probes == 2  # warm-up, then the recovery's probe
        again = h.consume(job(max_tokens=2))
        await settle()
        assert again["error"] is None and len(again["events"]) == 2

    run_actor(test)


def test_an_idle_model_is_probed() -> None:
    async def test(h: Harness) -> None:
        await settle()
        assert h.executor.probes == 1
        h.clock.jump(PROBE_INTERVAL)
        await settle()
        assert h.executor.probes == 2

    run_actor(test)


def test_idle_probes_run_through_the_watchdog_and_are_counted() -> None:
    """The production path: the actor's idle timer, the watchdog's deadline and counters."""

    async def test(h: Harness) -> None:
        def probes(result: str) -> float | None:
            return h.metric("neuron_watchdog_idle_probes_total", result=result)

        await settle()
        assert h.executor.probes == 1 and probes("ok") is None  # the warm-up is not idle
        h.clock.jump(PROBE_INTERVAL)
        await settle()
        assert h.executor.probes == 2 and probes("ok") == 1
        # a probe that fails: counted, then recovered like a failed step
        h.executor.fail_next_probe = RuntimeError("CUDA error: an illegal memory access")
        h.clock.jump(PROBE_INTERVAL)
        await settle()
        assert probes("failed") == 1 and h.actor.state == "serving"
        assert h.actor.info().last_error.startswith("RuntimeError")
        # a probe that hangs past the step deadline: a wedge, recovered once it comes back
        h.threads.hold()
        h.clock.jump(PROBE_INTERVAL)
        await settle()
        assert h.actor.state == "serving" and probes("wedged") is None  # still in time
        h.clock.jump(STEP_TIMEOUT)
        await settle()
        assert h.actor.state == "recovering" and probes("wedged") == 1
        h.threads.release()
        await settle()
        assert h.actor.state == "serving"
        watchdog = msgspec.to_builtins(h.actor.info())["watchdog"]
        assert watchdog["probes"] == 3 and watchdog["recoveries"] == 2
        assert watchdog["last_wedge"]["what"] == "probe"
        assert h.metric("neuron_watchdog_wedges_total", what="probe") == 1
        assert probes("ok") == 1 and probes("failed") == 1

    run_actor(test)


def test_info_lists_ranks_and_counts() -> None:
    async def test(h: Harness) -> None:
        h.threads.hold()
        h.consume(job())
        await settle()
        info = msgspec.to_builtins(h.actor.info())  # as /v1/node shows it
        assert info["state"] == "serving" and info["tp"] == 1 and info["weights"] == "float32"
        assert info["ranks"] == [{"device": "cpu", "heads": 9, "kv_heads": 3}]
        assert info["devices"] == ["cpu"] and info["running"] == 1
        assert info["watchdog"]["state"] == "stepping"
        inflight = h.actor.inflight()
        assert inflight[0].state == "running" and inflight[0].age_s >= 0
        h.threads.release()

    run_actor(test)


def test_a_failing_load_is_a_model_load_error() -> None:
    def broken() -> FakeExecutor:
        raise ValueError("bad tensor")

    async def main() -> None:
        actor = ModelActor(spec(), broken, max_queue=1)
        async with trio.open_nursery() as nursery:
            with pytest.raises(ModelLoadError, match="bad tensor"):
                await nursery.start(actor.run)
        assert actor.state == "unloaded"

    trio.run(main)


def test_the_warm_up_runs_before_the_actor_reports_started() -> None:
    executor = FakeExecutor()

    async def main() -> None:
        actor = ModelActor(spec(), lambda: executor, max_queue=1)
        async with trio.open_nursery() as nursery:
            started = await nursery.start(actor.run)
            # ready means warmed up: the probe, then the warm-up requests, each once
            assert started is actor and actor.state == "serving"
            assert (executor.probes, executor.warm_ups) == (1, 1)
            await actor.unload()

    trio.run(main)


def test_a_failing_warm_up_fails_the_load() -> None:
    executor = FakeExecutor()
    executor.fail_next_warm_up = RuntimeError("sampler broke")

    async def main() -> None:
        actor = ModelActor(spec(), lambda: executor, max_queue=1)
        async with trio.open_nursery() as nursery:
            with pytest.raises(ModelLoadError, match="sampler broke"):
                await nursery.start(actor.run)
        assert actor.state == "unloaded" and executor.closed

    trio.run(main)


def test_event_stream_merges_past_its_capacity() -> None:
    async def main() -> None:
        stream = EventStream(capacity=2)
        for i in range(5):
            stream.push(SequenceEvent(1, text=str(i), token_ids=[i], completion_tokens=i + 1))
        stream.close()
        got = [e async for e in stream]
        assert [e.text for e in got] == ["0", "1234"]
        assert got[1].token_ids == [1, 2, 3, 4] and got[1].completion_tokens == 5

    trio.run(main)


def test_merge_events_keeps_the_finish() -> None:
    a = SequenceEvent(1, text="a", token_ids=[1], logprobs=None)
    b = SequenceEvent(1, text="b", token_ids=[2], finish_reason="stop", prompt_tokens=3)
    merged = merge_events(a, b)
    assert (merged.text, merged.token_ids, merged.finish_reason) == ("ab", [1, 2], "stop")
    assert merged.prompt_tokens == 3 and merged.logprobs is None
