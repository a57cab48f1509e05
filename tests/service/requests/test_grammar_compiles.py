"""Grammar compiles seen from trio (issue 25 finding 4): shared, withdrawn when abandoned,
never on trio's default thread limiter. Decisions are tested with a fake thread pool that
the test drives; one test runs the model actor with the real compile thread."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest
import trio
import trio.testing

from neuron_trio.engine.text.structured.compile_threads import (
    COMPILE_NICE,
    CompileJob,
    CompileThreads,
)
from neuron_trio.engine.types import Constraint, SamplingParams
from neuron_trio.errors import RequestError
from neuron_trio.service.api import GenerationJob
from neuron_trio.service.requests.grammar_compiles import GrammarCompiles
from tests.service.actor_harness import Harness, run_actor


class HeldThreads:
    """A CompileThreads stand-in: jobs wait until the test runs them (`run_next`)."""

    def __init__(self) -> None:
        self.jobs: list[CompileJob] = []
        self.closed = False

    def submit(self, job: CompileJob) -> None:
        self.jobs.append(job)

    def close(self) -> None:
        self.closed = True

    def run_next(self) -> CompileJob:
        job = self.jobs.pop(0)
        job._run()  # on_done hands the result to trio with run_sync_soon, as a thread would
        return job


def _schema(i: int) -> Constraint:
    return Constraint("json", schema=f'{{"type":"object","x-{i}":1}}')


def _compiles(compiled: list[Constraint], threads: HeldThreads) -> GrammarCompiles:
    def compile_fn(constraint: Constraint) -> object:
        compiled.append(constraint)
        if "bad" in constraint.schema:
            raise RequestError("response_format: bad", param="response_format")
        return constraint

    return GrammarCompiles(compile_fn, lambda c: c in compiled, threads)  # type: ignore[arg-type]


def test_identical_compiles_in_flight_share_one() -> None:
    async def main() -> None:
        threads, compiled = HeldThreads(), []
        compiles = _compiles(compiled, threads)
        done: list[int] = []

        async def caller(i: int) -> None:
            await compiles.compile(_schema(0))
            done.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(caller, i)
            await trio.testing.wait_all_tasks_blocked()
            assert len(threads.jobs) == 1
            threads.run_next()
        assert sorted(done) == [0, 1, 2, 3, 4] and compiled == [_schema(0)]
        stats = compiles.statistics()
        assert stats.compiled == 1 and stats.shared == 4 and stats.in_flight == 0
        await compiles.compile(_schema(0))  # a cache hit: no job at all
        assert threads.jobs == []

    trio.run(main)


def test_a_compile_error_reaches_every_caller() -> None:
    async def main() -> None:
        threads, compiled = HeldThreads(), []
        compiles = _compiles(compiled, threads)
        errors: list[BaseException] = []
        bad = Constraint("json", schema='"bad"')

        async def caller() -> None:
            try:
                await compiles.compile(bad)
            except RequestError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            nursery.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()
            threads.run_next()
        assert len(errors) == 2 and all(e.status == 400 for e in errors)

    trio.run(main)


def test_abandoned_compiles_are_withdrawn_before_they_cost() -> None:
    async def main() -> None:
        threads, compiled = HeldThreads(), []
        compiles = _compiles(compiled, threads)
        async with trio.open_nursery() as nursery:
            for i in range(60):  # 60 distinct schemas, then every client disconnects
                nursery.start_soon(compiles.compile, _schema(i))
            await trio.testing.wait_all_tasks_blocked()
            assert len(threads.jobs) == 60 and compiles.statistics().in_flight == 60
            running = threads.jobs.pop(0)
            assert running._take()  # a thread took the first one: it cannot be stopped
            nursery.cancel_scope.cancel()
        stats = compiles.statistics()
        assert stats.withdrawn == 59 and stats.in_flight == 1  # the running one only
        for job in threads.jobs:
            assert job.state == "withdrawn"
            job._run()  # a thread reaching a withdrawn job skips it
        assert compiled == []
        ((_, kept),) = compiles._flights  # the running one's (tenant, schema)
        # a new request for the running schema joins it instead of compiling it again
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compiles.compile, kept)
            await trio.testing.wait_all_tasks_blocked()
            assert compiles.statistics().shared == 1
            running.result = running.fn()
            running._state = "done"
            running.on_done(running)
        assert compiled == [kept] and compiles.statistics().in_flight == 0

    trio.run(main)


def test_compile_threads_run_jobs_with_a_large_stack_and_withdrawn_ones_never() -> None:
    seen: list[Any] = []
    finished = threading.Event()

    def on_done(job: CompileJob) -> None:
        seen.append((job.result, job.error))
        finished.set()

    threads = CompileThreads(1, stack_bytes=32 << 20)
    gate = threading.Event()
    first = CompileJob(lambda: gate.wait(5) and threading.current_thread().name, on_done)
    withdrawn = CompileJob(lambda: "never", on_done)
    failing = CompileJob(lambda: 1 / 0, on_done)
    for job in (first, withdrawn, failing):
        threads.submit(job)
    assert withdrawn.withdraw()
    gate.set()
    threads.close()
    for thread in threads._threads:
        thread.join(10)
    assert seen[0] == ("grammar-compile-0", None)
    assert len(seen) == 2 and isinstance(seen[1][1], ZeroDivisionError)
    assert not first.withdraw()  # done: too late


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's nice value: Linux")
def test_compile_threads_run_at_the_lowest_priority_and_leave_the_callers_own() -> None:
    """A compile takes a core only when the step's threads leave one (issue 47: at the step's
    priority it slowed 2-core steps ~9x); the thread that created the pool keeps its priority."""
    niceness: list[int] = []
    done = threading.Event()

    def on_done(job: CompileJob) -> None:
        niceness.append(job.result)
        done.set()

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    threads = CompileThreads(1, name="test-nice")
    try:
        threads.submit(
            CompileJob(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), on_done)
        )
        assert done.wait(10)
    finally:
        threads.close()
    assert niceness == [COMPILE_NICE] and COMPILE_NICE == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


# ---- the model actor, with its real compile thread ------------------------------------------


def test_sixty_abandoned_compiles_hold_one_thread_and_none_of_trios_default_limiter() -> None:
    gate = threading.Event()
    started: list[Constraint] = []
    cached: set[Constraint] = set()

    def blocking_compile(constraint: Constraint) -> object:
        started.append(constraint)
        gate.wait(30)
        cached.add(constraint)
        return constraint

    async def test(h: Harness) -> None:
        h.engine.compile_constraint = blocking_compile  # type: ignore[method-assign]
        h.engine.constraint_compiled = cached.__contains__  # type: ignore[method-assign]
        limiter = trio.to_thread.current_default_thread_limiter()
        try:
            async with trio.open_nursery() as clients:
                for i in range(60):
                    params = SamplingParams(max_tokens=1, constraint=_schema(i))
                    job = GenerationJob(model="m", params=params, prompt="hi")
                    clients.start_soon(_enter, h, job)
                while not started:  # the compile thread took the first (a real thread)
                    await trio.lowlevel.checkpoint()
                await trio.testing.wait_all_tasks_blocked()
                assert limiter.borrowed_tokens == 0
                clients.cancel_scope.cancel()  # every client disconnects
            assert limiter.borrowed_tokens == 0
            assert len(started) == 1  # the 59 others never ran
        finally:
            gate.set()
        # the compile that ran serves the next request for its schema (joined, or cached)
        params = SamplingParams(max_tokens=1, constraint=started[0])
        async with h.actor.generate(GenerationJob(model="m", params=params, prompt="hi")):
            pass
        assert len(started) == 1

    run_actor(test)


async def _enter(h: Harness, job: GenerationJob) -> None:
    async with h.actor.generate(job):
        pytest.fail("the compile is held: no request gets this far")
