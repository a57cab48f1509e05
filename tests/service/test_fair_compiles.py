"""Grammar compiles shared fairly between tenants (issue 47 #3): the model's compile thread
takes the tenant served longest ago first, so one tenant's slow compiles delay another's by
at most one. Real threads, ordered by events (no sleeps)."""

from __future__ import annotations

import threading

import trio
import trio.testing

from neuron_trio.engine.text.structured.compile_threads import CompileJob, CompileThreads
from neuron_trio.engine.types import Constraint
from neuron_trio.service.requests.grammar_compiles import GrammarCompiles

WAIT_S = 30.0  # a bound on a wait that should take microseconds: never reached when it works


class Recorder:
    """Jobs that record the order they ran in; the first holds the thread until released."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.done = threading.Semaphore(0)

    def job(self, name: str, lane: str | None, *, hold: bool = False) -> CompileJob:
        def fn() -> str:
            self.ran.append(name)
            if hold:
                self.started.set()
                assert self.release.wait(WAIT_S)
            return name

        return CompileJob(fn, lambda job: self.done.release(), lane=lane)

    def wait_done(self, count: int) -> None:
        for _ in range(count):
            assert self.done.acquire(timeout=WAIT_S)


def test_a_second_tenant_waits_behind_one_compile_not_the_whole_queue() -> None:
    threads = CompileThreads(1, name="test-fair-compile")
    rec = Recorder()
    try:
        threads.submit(rec.job("slow-0", "flood", hold=True))
        assert rec.started.wait(WAIT_S)  # the thread holds the flood's first compile
        for i in range(1, 8):
            threads.submit(rec.job(f"slow-{i}", "flood"))
        threads.submit(rec.job("small", "other"))
        rec.release.set()
        rec.wait_done(9)
    finally:
        threads.close()
    # in arrival order "small" would run last, behind 8 slow compiles
    assert rec.ran[:2] == ["slow-0", "small"]
    assert rec.ran[2:] == [f"slow-{i}" for i in range(1, 8)]  # oldest first within a lane


def test_backlogged_tenants_take_turns() -> None:
    threads = CompileThreads(1, name="test-fair-compile")
    rec = Recorder()
    try:
        threads.submit(rec.job("hold", None, hold=True))
        assert rec.started.wait(WAIT_S)
        for i in range(3):
            threads.submit(rec.job(f"a{i}", "a"))
        for i in range(3):
            threads.submit(rec.job(f"b{i}", "b"))
        withdrawn = rec.job("c0", "c")
        threads.submit(withdrawn)
        assert withdrawn.withdraw()  # a withdrawn job is skipped, and costs no turn
        threads.submit(rec.job("c1", "c"))
        rec.release.set()
        rec.wait_done(8)
    finally:
        threads.close()
    assert rec.ran == ["hold", "a0", "b0", "c1", "a1", "b1", "a2", "b2"]


def test_the_same_schema_of_two_tenants_is_compiled_in_each_ones_turn() -> None:
    class Lanes:
        def __init__(self) -> None:
            self.jobs: list[CompileJob] = []

        def submit(self, job: CompileJob) -> None:
            self.jobs.append(job)

        def close(self) -> None:
            pass

    async def main() -> None:
        lanes = Lanes()
        schema = Constraint("json", schema='{"type":"object"}')
        compiles = GrammarCompiles(lambda c: c, lambda c: False, lanes)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compiles.compile, schema, "a")
            nursery.start_soon(compiles.compile, schema, "a")  # shares a's job
            nursery.start_soon(compiles.compile, schema, "b")  # its own, in b's lane
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(job.lane for job in lanes.jobs) == ["a", "b"]  # trio starts in any order
            assert compiles.statistics().shared == 1
            for job in lanes.jobs:
                job._run()
        assert compiles.statistics().in_flight == 0

    trio.run(main)
