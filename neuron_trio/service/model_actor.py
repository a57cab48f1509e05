"""One trio actor per loaded model: a bounded queue in front of the engine's slots.

Requests are tokenized and validated on the trio thread when they arrive (fast, and a bad
request gets its 400 before it waits anywhere), then wait in a bounded queue. The actor's
loop is the only code that touches the engine's mutable state: between steps it admits queued
requests into free slots and applies cancellations; while the engine has work it runs
`executor.step()` on a worker thread (through the watchdog, which bounds it) and routes each
event to its request's stream. Nothing blocking ever runs on the trio thread.

Each request's events reach it through an `EventStream` (`service/event_stream.py`), bounded
and never blocking the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar

import trio

from neuron_trio.config import ModelConfig, TpConfig
from neuron_trio.engine.prompt import PreparedPrompt, prepare_prompt
from neuron_trio.engine.text.native_errors import panics_as_model_file_errors
from neuron_trio.engine.types import EngineStatistics, SequenceEvent
from neuron_trio.errors import (
    ConfigError,
    ContextLengthError,
    ModelLoadError,
    NeuronError,
    QueueFullError,
    RequestError,
    StepTimeoutError,
    UnavailableError,
)
from neuron_trio.executor.api import ModelExecutor, ServingEngine
from neuron_trio.service.api import GenerationJob, template_message, with_default_max_tokens
from neuron_trio.service.event_stream import EventStream
from neuron_trio.service.grammar_compiles import GrammarCompiles, new_compile_threads
from neuron_trio.service.metrics.model import ModelActorStatistics, ModelMetrics
from neuron_trio.service.node_document import KVCacheInfo, ModelInfo, ModelMemory
from neuron_trio.service.wedge.watchdog import InflightRequest, Watchdog

log = logging.getLogger(__name__)

T = TypeVar("T")
INLINE_ENCODE_CHARS = 8192  # longer prompts are tokenized on a worker thread (chats: all)
# No tokenizer packs more characters than this into one token on average, so a prompt with
# more than context x this many characters cannot fit: refused before it is rendered.
MAX_CHARS_PER_TOKEN = 64
ModelState = Literal["loading", "serving", "recovering", "wedged", "unloading", "unloaded"]


@dataclass(eq=False)
class _Request:
    job: GenerationJob
    prompt_ids: list[int]
    chat: bool
    stream: EventStream
    enqueued_at: float  # trio clock (metrics)
    enqueued_wall: float = 0.0  # time.time() (forensics, read from other threads)
    seq_id: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    done: bool = False
    outcome: str = ""


# A burst of requests (a router's, or streams opened together on one HTTP/2 connection)
# arrives over a few milliseconds. From idle, the first would start a step alone and the rest
# would wait that whole step to join. So the loop waits for the burst to settle first: up to
# BURST_GAP_S for each next arrival, at most BURST_WINDOW_S in all (a lone request's first
# token comes BURST_GAP_S later; 8 streams measured 0.5 ms apart on a busy 2-core machine).
BURST_GAP_S = 0.001
BURST_WINDOW_S = 0.005


class ModelActor:
    """One loaded model: its executor, a bounded queue, and the loop that drives steps.

    Start with `await nursery.start(actor.run)`: it loads (on a worker thread), warms up with
    one probe step, then the warm-up requests (`executor.warm_up`), both bounded by the
    watchdog (a hang there is exit 70), and reports started once serving; a failed load
    raises ModelLoadError from `nursery.start`. `unload()` stops admitting, waits for
    in-flight requests, closes the executor, and returns once `run` has finished.

    Every step and probe goes through the watchdog (`run_step`); a step past its deadline
    fails the in-flight and queued requests with UnavailableError (503), and the loop awaits
    `watchdog.recover(executor)`, which returns once serving again (or never: exit 70).
    Without a watchdog (tests, tools) steps run on a plain worker thread, unbounded.
    """

    def __init__(
        self,
        spec: ModelConfig,
        loader: Callable[[], ModelExecutor],
        *,
        max_queue: int,
        watchdog: Watchdog | None = None,
        metrics: ModelMetrics | None = None,
        stream_capacity: int = 64,
        source_path: str | None = None,
        memory: ModelMemory | None = None,
        burst_gap_s: float = BURST_GAP_S,
        burst_window_s: float = BURST_WINDOW_S,
        load_timeout_s: float = float("inf"),
    ) -> None:
        self.spec = spec
        self.load_timeout_s = load_timeout_s  # the build on its worker thread (not warm-up)
        self.name = spec.name
        self.max_queue = max_queue
        # One idle-probe interval (tp.probe_interval_s): the watchdog's, which /v1/node shows.
        self.probe_interval_s = (
            watchdog.probe_interval_s if watchdog is not None else TpConfig().probe_interval_s
        )
        self.source_path = source_path
        self.memory = memory
        self.loaded_at: float | None = None  # unix seconds
        self.executor: ModelExecutor | None = None
        self.watchdog = watchdog
        self._state: ModelState = "loading"
        self._loader = loader
        self._metrics = metrics
        self._stream_capacity = stream_capacity
        # Invariant: a request is in `_queue` (no seq_id yet, in arrival order) or in
        # `_active` (keyed by its engine seq_id), never both; only the actor's loop moves it
        # between them, between steps, and it leaves both when its stream ends.
        self._queue: deque[_Request] = deque()
        self._active: dict[int, _Request] = {}
        self._cancels: list[int] = []
        self._open = 0  # generate() contexts not yet left
        self._wakeup = trio.Event()
        self._idle_lot = trio.lowlevel.ParkingLot()
        self._stopping = False
        self._force = False
        self._finished = trio.Event()
        self._limiter = trio.CapacityLimiter(1)  # a hung step keeps only this slot
        self._engine_stats: EngineStatistics | None = None
        self._steps = 0
        self._failures = 0
        self._last_error: str | None = None
        self._burst_gap_s, self._burst_window_s = burst_gap_s, burst_window_s
        self._compiles: GrammarCompiles | None = None  # started with the first constraint

    # ---- what the node reads -------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        if self.watchdog is not None and self.watchdog.state == "wedged":
            return "wedged"  # the deadman is firing
        return self._state

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def idle(self) -> bool:
        """No request queued, running, or still being read by its consumer."""
        return not self._queue and not self._active and not self._open

    @property
    def _engine_idle(self) -> bool:
        return not self._queue and not self._active

    @property
    def accepting(self) -> bool:
        return self.state == "serving" and not self._stopping

    def statistics(self) -> ModelActorStatistics:
        stats = self._engine_stats
        return ModelActorStatistics(
            name=self.name,
            state=self.state,
            queued=len(self._queue),
            running=len(self._active),
            slots_in_use=stats.slots_in_use if stats else 0,
            slots_total=self.spec.max_batch,
            steps=self._steps,
            failures=self._failures,
            kv_blocks_used=stats.kv_blocks_used if stats else 0,
            kv_blocks_total=stats.kv_blocks_total if stats else 0,
            kv_blocks_cached=stats.kv_blocks_cached if stats else 0,
            prefix_cache_queries_tokens=stats.prefix_cache_queries_tokens if stats else 0,
            prefix_cache_hits_tokens=stats.prefix_cache_hits_tokens if stats else 0,
            preemptions=stats.preemptions if stats else 0,
        )

    def inflight(self) -> list[InflightRequest]:
        """Queued and running requests with their ages (forensics: any thread may call it)."""
        now = time.time()
        return [
            InflightRequest(
                model=self.name,
                seq_id=r.seq_id,
                state="queued" if r.seq_id is None else "running",
                age_s=round(now - r.enqueued_wall, 3),
                prompt_tokens=len(r.prompt_ids),
                generated_tokens=r.tokens,
            )
            for r in [*list(self._active.values()), *list(self._queue)]
        ]

    def info(self) -> ModelInfo:
        """This model's entry in `/v1/node`."""
        ex = self.executor
        stats = self.statistics()
        ranks = list(ex.ranks) if ex else []
        return ModelInfo(
            name=self.name,
            state=stats.state,
            source=self.spec.source,
            path=self.source_path,
            dtype=self.spec.dtype,
            weights=ex.dtype if ex else None,
            tp=ex.tp if ex else self.spec.tp,
            max_batch=self.spec.max_batch,
            context=self.spec.context,
            slots_in_use=stats.slots_in_use,
            slots_total=stats.slots_total,
            kv_cache=KVCacheInfo.from_statistics(stats, prefix_cache=self.spec.prefix_cache),
            running=stats.running,
            queued=stats.queued,
            max_queue=self.max_queue,
            ranks=ranks,
            devices=[r.device for r in ranks],
            memory=self.memory,
            loaded_at=self.loaded_at,
            steps=stats.steps,
            step_failures=stats.failures,
            last_error=self._last_error,
            watchdog=self.watchdog.statistics() if self.watchdog is not None else None,
        )

    # ---- requests ------------------------------------------------------------------------

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.outcome(outcome)

    def _refuse_unless_accepting(self) -> None:
        if self.accepting:
            return
        self._count("rejected_unavailable")
        state = "unloading" if self._stopping else self.state
        if state == "recovering":
            raise UnavailableError(
                f"model {self.name!r} is recovering from a failed step",
                code="model_recovering",
                retry_after_s=5,
            )
        if state == "wedged":
            raise UnavailableError(
                f"model {self.name!r} is wedged; the node is restarting",
                code="model_wedged",
                retry_after_s=30,
            )
        raise UnavailableError(
            f"model {self.name!r} is {state}", code=f"model_{state}", retry_after_s=5
        )

    async def _encode(self, job: GenerationJob) -> tuple[list[int], bool]:
        """Token ids and the chat flag of `job`; RequestError (400) if it cannot run.

        Tokenizing touches only the tokenizer and template (never the engine's state), so it
        may run beside a step. Small prompts run on the trio thread (microseconds); long
        ones on a worker thread, so that /health never waits behind a 1 MB prompt.
        """
        assert self.executor is not None
        engine: ServingEngine = self.executor.engine
        size = len(job.prompt or "") + sum(len(m.content) for m in job.messages or ())
        if size > self.spec.context * MAX_CHARS_PER_TOKEN:
            self._count("rejected_invalid")
            raise ContextLengthError(
                f"the prompt has {size} characters, far more than model {self.name!r}'s "
                f"context of {self.spec.context} tokens can hold",
                param="messages" if job.messages is not None else "prompt",
            )

        def prepare() -> PreparedPrompt:
            return prepare_prompt(
                engine,
                job.params,
                text=job.prompt,
                messages=None
                if job.messages is None
                else [template_message(m) for m in job.messages],
                ids=job.prompt_ids,
                compile_constraint=False,  # done first, on the compile thread (below)
            )

        try:
            if job.params.constraint is not None:
                # cached for `add`, on the model's compile thread (grammar_compiles)
                if self._compiles is None:
                    self._compiles = GrammarCompiles(
                        engine.compile_constraint,
                        engine.constraint_compiled,
                        new_compile_threads(self.name),
                    )
                await self._compiles.compile(job.params.constraint)
            # Tools are rendered into the prompt as JSON of any size. A chat template is the
            # model file's code: it renders on a thread, under its own deadline and size
            # bounds (engine/text/template_sandbox.py), never on the event loop.
            if size > INLINE_ENCODE_CHARS or job.messages is not None or job.params.tools:
                prepared = await trio.to_thread.run_sync(prepare, abandon_on_cancel=True)
            else:
                prepared = prepare()
        except RequestError:
            self._count("rejected_invalid")
            raise
        return prepared.ids, prepared.chat

    def _queue_capacity(self) -> int:
        # Requests take the free slots first, then wait in a queue of max_queue.
        return self.max_queue + max(0, self.spec.max_batch - len(self._active))

    @asynccontextmanager
    async def generate(self, job: GenerationJob) -> AsyncIterator[EventStream]:
        """Queue `job`; the context's value iterates its events. See NodeService.generate.

        Tokenizes and validates on the trio thread (fast) so that a bad request is refused
        before it waits. Leaving the context before the last event cancels the sequence at
        the next step boundary (or drops it from the queue at once).
        """
        self._refuse_unless_accepting()
        ids, chat = await self._encode(job)
        job = with_default_max_tokens(job, len(ids), self.spec)
        self._refuse_unless_accepting()  # the state may have changed while encoding
        if len(self._queue) >= self._queue_capacity():
            self._count("rejected_queue_full")
            raise QueueFullError(
                f"model {self.name!r}: {self.max_queue} requests already wait for a slot",
                retry_after_s=max(1, len(self._queue) // max(1, self.spec.max_batch)),
            )
        request = _Request(
            job,
            ids,
            chat,
            EventStream(self._stream_capacity),
            enqueued_at=trio.current_time(),
            enqueued_wall=time.time(),
        )
        self._queue.append(request)
        self._open += 1
        self._wake()
        try:
            yield request.stream
        finally:
            self._open -= 1
            self._abandon(request)
            self._idle_lot.unpark_all()

    def _abandon(self, request: _Request) -> None:
        """The consumer left (client gone, or done): cancel at the next step boundary."""
        request.stream.close()
        if request.done:
            return
        if request.seq_id is None:
            try:
                self._queue.remove(request)
            except ValueError:
                pass
        else:
            self._cancels.append(request.seq_id)
        self._finish(request, "cancelled")
        self._wake()

    def _finish(self, request: _Request, outcome: str) -> None:
        if request.done:
            return
        request.done = True
        request.outcome = outcome
        if request.seq_id is not None and outcome != "cancelled":
            self._active.pop(request.seq_id, None)
        self._count(outcome)
        m = self._metrics
        if m is not None and request.tokens > 1:
            assert request.first_token_at is not None and request.last_token_at is not None
            span = request.last_token_at - request.first_token_at
            m.per_output_token(span / (request.tokens - 1))
        self._idle_lot.unpark_all()

    def _fail_all(self, error: UnavailableError) -> None:
        for request in [*self._queue, *self._active.values()]:
            request.stream.fail(error)
            self._finish(request, "unavailable")
        self._queue.clear()
        self._active.clear()
        self._idle_lot.unpark_all()

    def _wake(self) -> None:
        self._wakeup.set()

    async def wait_idle(self) -> None:
        """Return once no request is queued or running."""
        while not self.idle:
            await self._idle_lot.park()

    # ---- loading and unloading -------------------------------------------------------------

    async def _load(self) -> ModelExecutor:
        """Build the executor on a worker thread.

        Cancellation handling: the thread is abandoned; whatever it builds afterwards is
        closed on its own thread, so an interrupted load leaks nothing for long.
        """
        lock = threading.Lock()
        abandoned = False
        built: list[ModelExecutor] = []

        def build() -> ModelExecutor:
            executor = self._loader()
            with lock:
                if abandoned:
                    executor.close()
                else:
                    built.append(executor)
            return executor

        try:
            with panics_as_model_file_errors(f"model {self.name!r}"):
                return await trio.to_thread.run_sync(
                    build, abandon_on_cancel=True, thread_name=f"neuron-load-{self.name}"
                )
        except trio.Cancelled:
            with lock:
                abandoned = True
                leftovers = list(built)
            for executor in leftovers:
                threading.Thread(target=executor.close, daemon=True).start()
            raise

    async def _warm_up(self, executor: ModelExecutor) -> None:
        """The model's first forward (a probe), then its warm-up requests (`engine.warm_up`:
        the first real request then pays no one-time cost), each bounded: a hang here ends in
        exit 70 (the deadman); an error fails the load.

        The bound is the watchdog's `warm_up_s` (generous: first forwards pay one-time costs).
        """
        started = time.monotonic()
        if self.watchdog is not None:
            timeout_s = self.watchdog.warm_up_s
            await self.watchdog.run_or_die(executor.probe, what="warm-up", timeout_s=timeout_s)
            report = await self.watchdog.run_or_die(
                executor.warm_up, what="warm-up", timeout_s=timeout_s
            )
        else:
            await self._plain_thread(executor.probe, "warm-up")
            report = await self._plain_thread(executor.warm_up, "warm-up")
        log.info(
            "model %s: warmed up in %.2f s (%s)", self.name, time.monotonic() - started, report
        )

    async def _close(self, executor: ModelExecutor) -> None:
        await trio.to_thread.run_sync(
            executor.close, abandon_on_cancel=True, thread_name=f"neuron-close-{self.name}"
        )

    async def run(
        self, *, task_status: trio.TaskStatus[ModelActor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Load, warm up, report started, then serve until `unload()` (or cancellation)."""
        started = time.monotonic()
        try:
            try:
                with trio.fail_after(self.load_timeout_s):
                    self.executor = await self._load()
            except trio.TooSlowError:
                raise ModelLoadError(
                    f"model {self.name!r}: loading took longer than {self.load_timeout_s:g} s "
                    "(node.load_timeout_s)"
                ) from None
            # A Rust panic (pyo3's PanicException is a BaseException) is the file's fault.
            with panics_as_model_file_errors(f"model {self.name!r}"):
                await self._warm_up(self.executor)
            self._engine_stats = self.executor.engine.statistics()
        except BaseException as exc:
            self._state = "unloaded"
            self._finished.set()
            if self.executor is not None and isinstance(exc, Exception):
                await self._close(self.executor)
            # A ConfigError (tp that does not divide the heads) stays one: exit 78, or a 400.
            if isinstance(exc, ModelLoadError | ConfigError) or not isinstance(exc, Exception):
                raise
            raise ModelLoadError(f"model {self.name!r}: {type(exc).__name__}: {exc}") from exc
        self.loaded_at = time.time()
        self._state = "serving"
        log.info("model %s: serving (ready in %.1f s)", self.name, time.monotonic() - started)
        task_status.started(self)
        try:
            await self._serve(self.executor)
            self._state = "unloading"
            executor, self.executor = self.executor, None
            await self._close(executor)
            log.info("model %s: unloaded", self.name)
        finally:
            if self._compiles is not None:
                self._compiles.close()
            self._fail_all(
                UnavailableError(f"model {self.name!r} was stopped", code="model_unloaded")
            )
            self._state = "unloaded"
            self._finished.set()

    async def unload(self, *, force: bool = False) -> None:
        """Stop taking requests, wait for the queued and running ones, close the executor.

        With `force`, queued and running requests are failed at once (503) instead, and the
        sequences dropped at the next step boundary (shutdown after a drain that timed out).
        Returns once `run` has finished. Cancellation handling: cancelling the caller stops
        the wait only; the unload goes on in the actor.
        """
        self._stopping = True
        if force:
            self._force = True
            self._fail_all(
                UnavailableError(f"model {self.name!r} is being unloaded", code="model_unloading")
            )
        self._wake()
        await self._finished.wait()

    # ---- the loop --------------------------------------------------------------------------

    async def _plain_thread(self, fn: Callable[[], T], what: str) -> T:
        return await trio.to_thread.run_sync(
            fn,
            abandon_on_cancel=True,
            limiter=self._limiter,
            thread_name=f"neuron-{what}-{self.name}",
        )

    async def _step(self, executor: ModelExecutor) -> list[SequenceEvent]:
        """One engine step off the trio thread, under the watchdog (when there is one).

        Raises StepTimeoutError past the step deadline (then `recover` must follow).
        Cancellation handling: the thread is abandoned and keeps the step limiter's slot.
        """
        if self.watchdog is not None:
            return await self.watchdog.run_step(executor.step, inflight=self.inflight)
        return await self._plain_thread(executor.step, "step")

    async def _idle_probe(self, executor: ModelExecutor) -> None:
        """The idle probe: one tiny forward, counted by the watchdog (ok, failed, wedged)."""
        if self.watchdog is not None:
            await self.watchdog.run_idle_probe(executor.probe, inflight=self.inflight)
        else:
            await self._plain_thread(executor.probe, "probe")

    def _apply_cancels(self, engine: ServingEngine) -> None:
        for seq_id in self._cancels:
            engine.cancel(seq_id)
            self._active.pop(seq_id, None)
        self._cancels.clear()

    def _admit(self, engine: ServingEngine) -> None:
        # A request of n choices takes n of max_batch at once (its prompt is prefilled once,
        # shared), and waits until the KV pool has its prompt's blocks.
        while self._queue and engine.can_admit(
            len(self._queue[0].prompt_ids), self._queue[0].job.params.n
        ):
            request = self._queue.popleft()
            try:
                seq_id = engine.add(
                    request.prompt_ids,
                    request.job.params,
                    chat=request.chat,
                    cache_salt=request.job.cache_salt,
                )
            except NeuronError as exc:  # validated on arrival: should not happen
                request.stream.fail(exc)
                self._finish(request, "error")
                continue
            request.seq_id = seq_id
            self._active[seq_id] = request
            if self._metrics is not None:
                self._metrics.admitted(len(request.prompt_ids))

    async def _serve(self, executor: ModelExecutor) -> None:
        engine: ServingEngine = executor.engine
        while True:
            self._wakeup = trio.Event()  # before looking: a wake from now on is not lost
            self._apply_cancels(engine)
            if self._force:
                engine.cancel_all()
                return
            if self._stopping and self._engine_idle:
                return  # consumers may still read their last events: they need no engine
            self._admit(engine)
            self._engine_stats = engine.statistics()  # slots freed by cancels show at once
            if not engine.has_work:
                for request in list(self._active.values()):  # the engine dropped it silently
                    request.stream.fail(UnavailableError("the engine dropped the sequence"))
                    self._finish(request, "error")
                with trio.move_on_after(self.probe_interval_s) as idle:
                    await self._wakeup.wait()
                if idle.cancelled_caught:
                    await self._guarded(executor, self._idle_probe, "probe")
                else:
                    await self._gather_burst()
                continue
            events = await self._guarded(executor, self._step, "step")
            if events is not None:
                self._steps += 1
                self._route(events)
            self._engine_stats = engine.statistics()

    async def _gather_burst(self) -> None:
        """Woken from idle: wait while requests keep arriving (see BURST_GAP_S), so that a
        burst starts in one step. Returns at once when a batch is full or the actor stops."""
        if self._burst_gap_s <= 0:
            return
        end = trio.current_time() + self._burst_window_s
        while len(self._queue) < self.spec.max_batch and not self._stopping:
            seen = len(self._queue)
            with trio.move_on_at(min(end, trio.current_time() + self._burst_gap_s)):
                while len(self._queue) <= seen and not self._stopping:
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
            if len(self._queue) <= seen:
                return  # no arrival within the gap (or the window is over)

    async def _guarded(
        self,
        executor: ModelExecutor,
        call: Callable[[ModelExecutor], Awaitable[T]],
        what: str,
    ) -> T | None:
        """Run a step or probe; on a wedge or a failure, fail in-flight requests and recover."""
        try:
            return await call(executor)
        except StepTimeoutError as exc:
            await self._recover(executor, exc, wedged=True)
        except Exception as exc:
            log.error("model %s: %s failed", self.name, what, exc_info=True)
            await self._recover(executor, exc, wedged=False)
        return None

    async def _recover(self, executor: ModelExecutor, exc: BaseException, *, wedged: bool) -> None:
        self._failures += 1
        self._last_error = f"{type(exc).__name__}: {exc}"
        self._state = "recovering"
        self._fail_all(
            UnavailableError(
                f"model {self.name!r} {'wedged' if wedged else 'failed a step'}; "
                "it is recovering: retry",
                code="model_recovering",
                retry_after_s=5,
            )
        )
        if self.watchdog is not None:
            # Abort (tp > 1), wait for the step thread, re-create, probe: returns once the
            # model can serve again; otherwise the deadman ends the process (exit 70).
            await self.watchdog.recover(executor)
            if self.watchdog.state == "wedged":
                await trio.sleep_forever()  # the deadman is firing: the process is ending
        # A failed or aborted step left no sequence half-advanced; drop them all (their
        # requests were failed above) so that the slots are free again.
        executor.engine.cancel_all()
        self._cancels.clear()
        self._engine_stats = executor.engine.statistics()
        self._state = "serving"
        log.warning("model %s: serving again after %s", self.name, self._last_error)

    def _route(self, events: list[SequenceEvent]) -> None:
        now = trio.current_time()
        for event in events:
            request = self._active.get(event.seq_id)
            if request is None or request.done:
                continue  # cancelled since the step started
            n = len(event.token_ids)
            if n:
                if request.first_token_at is None:
                    request.first_token_at = now
                    if self._metrics is not None:
                        self._metrics.first_token(now - request.enqueued_at)
                request.last_token_at = now
                request.tokens += n
                if self._metrics is not None:
                    self._metrics.generated(n)
            request.stream.push(event)
            if event.finish_reason is not None and not event.more_choices:
                request.stream.close()
                self._finish(request, event.finish_reason)
