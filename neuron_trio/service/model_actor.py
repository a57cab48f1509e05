"""One trio actor per loaded model: a bounded queue in front of the engine's slots.

Each request's prompt is prepared when it arrives, templated, tokenized and checked once
(`service/requests/prompt_intake.py`, `Engine.prepare`: a bad request gets its 400 before it waits
anywhere), then waits in a bounded queue; `engine.add` trusts the `PreparedPrompt`. The actor's
loop is the only code that touches the engine's mutable state: between steps it admits queued
requests into free slots and applies cancellations; while the engine has work it runs
`executor.step()` on a worker thread (through the watchdog, which bounds it) and routes each
event to its request's stream. Nothing blocking ever runs on the trio thread.

Each request's events reach it through an `EventStream` (`service/requests/event_stream.py`), bounded
and never blocking the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TypeVar

import trio

from neuron_trio.config import ModelConfig, WatchdogConfig
from neuron_trio.errors import (
    ConfigError,
    ModelLoadError,
    QueueFullError,
    RequestError,
    StepTimeoutError,
    UnavailableError,
)
from neuron_trio.executor.api import (
    EngineStatistics,
    ModelExecutor,
    PreparedPrompt,
    SequenceEvent,
    ServingEngine,
    panics_as_model_file_errors,
)
from neuron_trio.service.api import GenerationJob, Tokenized, TokenizeJob
from neuron_trio.service.documents.node_document import (
    KVCacheInfo,
    ModelInfo,
    ModelMemory,
    SpeculationInfo,
)
from neuron_trio.service.metrics.model import ModelActorStatistics, ModelMetrics
from neuron_trio.service.model_state import ModelHealth, ModelState
from neuron_trio.service.requests.event_stream import EventStream
from neuron_trio.service.requests.executor_calls import ExecutorCalls
from neuron_trio.service.requests.grammar_compiles import GrammarCompiles, new_compile_threads
from neuron_trio.service.requests.prompt_intake import prepare_job_prompt
from neuron_trio.service.requests.request_table import ActorRequest, RequestTable
from neuron_trio.service.requests.tenant_limits import TenantLimitError, TenantPolicy
from neuron_trio.service.requests.tokenize import detokenize_ids, tokenize_job
from neuron_trio.service.wedge.records import InflightRequest
from neuron_trio.service.wedge.watchdog import Watchdog

log = logging.getLogger(__name__)

T = TypeVar("T")


# A burst of requests (a router's, or streams opened together on one HTTP/2 connection)
# arrives over a few milliseconds. From idle, the first would start a step alone and the rest
# would wait that whole step to join. So the loop waits for the burst to settle first: up to
# BURST_GAP_S for each next arrival, at most BURST_WINDOW_S in all (a lone request's first
# token comes BURST_GAP_S later; 8 streams measured 0.5 ms apart on a busy 2-core machine).
BURST_GAP_S = 0.001
BURST_WINDOW_S = 0.005


def _not_loaded(max_batch: int) -> EngineStatistics:
    """The engine's statistics before there is an engine: nothing in use, nothing counted."""
    return EngineStatistics(
        slots_total=max_batch,
        slots_in_use=0,
        prefilling=0,
        decoding=0,
        steps=0,
        prompt_tokens_total=0,
        generated_tokens_total=0,
    )


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
    Without a watchdog (tests, tools) steps run on a plain worker thread, unbounded
    (`service/requests/executor_calls.py`).
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
        tenants: Mapping[str, TenantPolicy] | None = None,
    ) -> None:
        self.spec = spec
        self.load_timeout_s = load_timeout_s  # the build on its worker thread (not warm-up)
        self.name = spec.name
        self.max_queue = max_queue
        # One idle-probe interval (watchdog.probe_interval_s): the watchdog's, which /v1/node
        # shows.
        self.probe_interval_s = (
            watchdog.probe_interval_s if watchdog is not None else WatchdogConfig().probe_interval_s
        )
        self.source_path = source_path
        self.memory = memory
        self.loaded_at: float | None = None  # unix seconds
        self.executor: ModelExecutor | None = None
        self.watchdog = watchdog
        # The model's one health state machine (model_state.MOVES): moved by this actor; the
        # watchdog reports "wedged" to it; the shared deadman firing reads as "wedged".
        self.health = ModelHealth(
            self.name, process_ending=watchdog.deadman_firing if watchdog is not None else None
        )
        if watchdog is not None:
            watchdog.report_to(self.health)
        self._loader = loader
        self._metrics = metrics
        self._stream_capacity = stream_capacity
        self._calls = ExecutorCalls(self.name, watchdog)
        self._requests = RequestTable(self.name, metrics, self._wake, tenants)
        self._wakeup = trio.Event()
        self._stopping = False
        self._force = False
        self._finished = trio.Event()
        self._engine_stats = _not_loaded(spec.max_batch)  # the engine's, read between steps
        self._steps = 0
        self._failures = 0
        self._last_error: str | None = None
        self._burst_gap_s, self._burst_window_s = burst_gap_s, burst_window_s
        self._compiles: GrammarCompiles | None = None  # started with the first constraint

    # ---- what the node reads -------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self.health.state

    @property
    def context(self) -> int:
        """The effective context: the engine's once loaded (the configured one capped by the
        model's own), the configured one before."""
        ex = self.executor
        return ex.engine.context if ex is not None else self.spec.context

    @property
    def queued(self) -> int:
        return len(self._requests.queue)

    @property
    def running(self) -> int:
        return len(self._requests.active)

    @property
    def idle(self) -> bool:
        """No request queued, running, or still being read by its consumer."""
        return self._requests.idle

    @property
    def accepting(self) -> bool:
        return self.state == "serving" and not self._stopping

    def statistics(self) -> ModelActorStatistics:
        return ModelActorStatistics(
            name=self.name,
            state=self.state,
            queued=self.queued,
            running=self.running,
            slots_total=self.spec.max_batch,
            steps=self._steps,
            failures=self._failures,
            engine=self._engine_stats,
        )

    def inflight(self) -> list[InflightRequest]:
        """Queued and running requests with their ages (forensics: any thread may call it)."""
        return self._requests.inflight()

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
            context=self.context,
            slots_in_use=stats.engine.slots_in_use,
            slots_total=stats.slots_total,
            kv_cache=KVCacheInfo.from_statistics(stats.engine, prefix_cache=self.spec.prefix_cache),
            speculative=self._speculation(stats.engine),
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

    def _speculation(self, engine: EngineStatistics) -> SpeculationInfo | None:
        config = self.spec.speculative
        if config is None:
            return None
        return SpeculationInfo.from_statistics(engine, config.method, config.num_tokens)

    # ---- requests ------------------------------------------------------------------------

    def _refuse_unless_accepting(self, tenant: str | None = None) -> None:
        if self.accepting:
            return
        self._requests.count("rejected_unavailable", tenant)
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

    async def _prepare(self, job: GenerationJob) -> PreparedPrompt | None:
        """`job`'s prompt, checked (`prompt_intake`); RequestError (400) if it cannot run. None
        without an engine (the loop has ended): `generate` refuses the request then."""
        if self.executor is None:
            return None
        engine: ServingEngine = self.executor.engine
        try:
            return await prepare_job_prompt(
                engine, job, self.spec, lambda: self._grammar_compiles(engine)
            )
        except RequestError:
            self._requests.count("rejected_invalid", job.tenant)
            raise

    async def tokenize(self, job: TokenizeJob) -> Tokenized:
        """See NodeService.tokenize (the node has resolved `job.model` to this model)."""
        return await tokenize_job(self._prompt_engine(), job, context=self.spec.context)

    async def detokenize(self, ids: tuple[int, ...]) -> str:
        """See NodeService.detokenize."""
        return await detokenize_ids(self._prompt_engine(), ids)

    def _prompt_engine(self) -> ServingEngine:
        """The engine, for its tokenizer and template only (never its sequences)."""
        self._refuse_unless_accepting()
        assert self.executor is not None
        return self.executor.engine

    def _grammar_compiles(self, engine: ServingEngine) -> GrammarCompiles:
        if self._compiles is None:
            self._compiles = GrammarCompiles(
                engine.compile_constraint,
                engine.constraint_compiled,
                new_compile_threads(self.name),
            )
        return self._compiles

    def _queue_capacity(self) -> int:
        # Requests take the free slots first, then wait in a queue of max_queue.
        return self.max_queue + max(0, self.spec.max_batch - self.running)

    @asynccontextmanager
    async def generate(self, job: GenerationJob) -> AsyncIterator[EventStream]:
        """Queue `job`; the context's value iterates its events. See NodeService.generate.

        The prompt is prepared and checked first, so that a bad request is refused (400)
        before it waits. Then the model's state is checked, once, where the request queues:
        no await lies between that check and `enqueue`, so a request never joins a queue the
        loop has stopped serving. Leaving the context before the last event cancels the
        sequence at the next step boundary (or drops it from the queue at once).
        """
        prepared = await self._prepare(job)
        self._refuse_unless_accepting(job.tenant)
        assert prepared is not None  # accepting: the engine is loaded (`run`)
        try:
            self._requests.check_limits(job.tenant, self.spec.max_batch)
        except TenantLimitError:
            self._requests.count("rejected_queue_full", job.tenant)  # a 429 naming the limit
            raise
        if self.queued >= self._queue_capacity():
            self._requests.count("rejected_queue_full", job.tenant)
            raise QueueFullError(
                f"model {self.name!r}: {self.max_queue} requests already wait for a slot",
                retry_after_s=max(1, self.queued // max(1, self.spec.max_batch)),
            )
        request = ActorRequest(
            job,
            prepared,
            EventStream(self._stream_capacity),
            enqueued_at=trio.current_time(),
            enqueued_wall=time.time(),
        )
        self._requests.enqueue(request)
        self._wake()
        try:
            yield request.stream
        finally:
            self._requests.leave(request)

    def _wake(self) -> None:
        self._wakeup.set()

    async def wait_idle(self) -> None:
        """Return once no request is queued or running."""
        await self._requests.wait_idle()

    # ---- loading and unloading -------------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[ModelActor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Load, warm up, report started, then serve until `unload()` (or cancellation)."""
        started = time.monotonic()
        try:
            self.executor = await self._calls.load(self._loader, self.load_timeout_s)
            # A Rust panic (pyo3's PanicException is a BaseException) is the file's fault.
            with panics_as_model_file_errors(f"model {self.name!r}"):
                await self._calls.warm_up(self.executor)
            self._engine_stats = self.executor.engine.statistics()
        except BaseException as exc:
            self.health.move("unloaded", f"the load failed: {type(exc).__name__}")
            self._finished.set()
            if self.executor is not None and isinstance(exc, Exception):
                await self._calls.close(self.executor)
            self._calls.close_thread()  # the forward thread, if no executor closed it
            # A ConfigError (tp that does not divide the heads) stays one: exit 78, or a 400.
            if isinstance(exc, ModelLoadError | ConfigError) or not isinstance(exc, Exception):
                raise
            raise ModelLoadError(f"model {self.name!r}: {type(exc).__name__}: {exc}") from exc
        self.loaded_at = time.time()
        self.health.move("serving", "loaded and warmed up")
        log.info("model %s: serving (ready in %.1f s)", self.name, time.monotonic() - started)
        task_status.started(self)
        try:
            await self._serve(self.executor)
            self.health.move("unloading", "its last requests done")
            executor, self.executor = self.executor, None
            await self._calls.close(executor)
            log.info("model %s: unloaded", self.name)
        finally:
            self._calls.close_thread()  # cancelled before the close: still end it
            if self._compiles is not None:
                self._compiles.close()
            self._requests.fail_all(
                UnavailableError(f"model {self.name!r} was stopped", code="model_unloaded")
            )
            self.health.move("unloaded", "stopped")
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
            self._requests.fail_all(
                UnavailableError(f"model {self.name!r} is being unloaded", code="model_unloading")
            )
        self._wake()
        await self._finished.wait()

    # ---- the loop --------------------------------------------------------------------------

    async def _step(self, executor: ModelExecutor) -> list[SequenceEvent]:
        return await self._calls.step(executor, self.inflight)

    async def _idle_probe(self, executor: ModelExecutor) -> None:
        await self._calls.idle_probe(executor, self.inflight)

    async def _serve(self, executor: ModelExecutor) -> None:
        engine: ServingEngine = executor.engine
        requests = self._requests
        engine.share_fairly(requests.fair)
        while True:
            self._wakeup = trio.Event()  # before looking: a wake from now on is not lost
            requests.apply_cancels(engine)
            if self._force:
                engine.cancel_all()
                return
            if self._stopping and requests.engine_idle:
                return  # consumers may still read their last events: they need no engine
            requests.admit(engine)
            self._engine_stats = engine.statistics()  # slots freed by cancels show at once
            if not engine.has_work:
                for request in list(requests.active.values()):  # the engine dropped it silently
                    request.stream.fail(UnavailableError("the engine dropped the sequence"))
                    requests.finish(request, "error")
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
                requests.route(events)
            self._engine_stats = engine.statistics()

    async def _gather_burst(self) -> None:
        """Woken from idle: wait while requests keep arriving (see BURST_GAP_S), so that a
        burst starts in one step. Returns at once when a batch is full or the actor stops."""
        if self._burst_gap_s <= 0:
            return
        end = trio.current_time() + self._burst_window_s
        while self.queued < self.spec.max_batch and not self._stopping:
            seen = self.queued
            with trio.move_on_at(min(end, trio.current_time() + self._burst_gap_s)):
                while self.queued <= seen and not self._stopping:
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
            if self.queued <= seen:
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
        self.health.move("recovering", self._last_error)
        self._requests.fail_all(
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
            if self.health.state == "wedged":
                await trio.sleep_forever()  # the deadman is firing: the process is ending
        # A failed or aborted step left no sequence half-advanced; drop them all (their
        # requests were failed above) so that the slots are free again.
        executor.engine.cancel_all()
        self._requests.cancels.clear()
        self._engine_stats = executor.engine.statistics()
        self.health.move("serving", "recovered")
        log.warning("model %s: serving again after %s", self.name, self._last_error)
