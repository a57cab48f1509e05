"""A model's grammar compiles, seen from trio: shared, withdrawn when abandoned, never on
trio's default thread limiter.

`GrammarCompiles.compile(constraint)` returns once the engine's grammar cache holds
`constraint` (so that the engine's own `compile_constraint` in `add` is a hit), or raises the
compile's RequestError (400). Three rules, for issue 25 finding 4 (60 heavy schemas sent and
abandoned at once held trio's 40 default threads and slowed a long chat from 2 s to 51 s):

- compiles run on the model's `CompileThreads` (one by default: a two-core node keeps a core
  for the step), never through `trio.to_thread`'s shared default limiter;
- identical constraints of one tenant in flight share one compile (the second caller waits
  for the first);
- the compile thread serves tenants in turn (issue 47 #3: `CompileThreads` takes the tenant
  served longest ago first), so one tenant's slow compiles delay another's by at most one;
  two tenants' identical compiles are two jobs, one in each tenant's turn (the second is then
  a cache hit), so that neither waits in the other's line;
- a compile whose every caller has left (client gone, request cancelled) before a thread took
  it is withdrawn and never runs; one already running finishes (the compiler cannot be
  interrupted; the schema bounds keep it under about a second) and its result is cached.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from neuron_trio.executor.api import CompileJob, CompileThreads, Constraint

__all__ = ["GrammarCompileStatistics", "GrammarCompiles"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarCompileStatistics:
    in_flight: int  # distinct compiles queued or running
    compiled: int  # compiles that ran
    shared: int  # callers that joined a compile already in flight
    withdrawn: int  # compiles dropped before they ran: every caller had left


class _Flight:
    """One compile in flight and the callers waiting for it."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.waiters = 0
        self.error: BaseException | None = None
        self.job: CompileJob | None = None


class GrammarCompiles:
    """Compiles for one model; call from the trio thread that created it.

    `compile_fn(constraint)`: compiles and caches (blocking; `Engine.compile_constraint`).
    `is_cached(constraint)`: True when `compile_fn` would be a cache hit (thread-safe, fast).
    """

    def __init__(
        self,
        compile_fn: Callable[[Constraint], object],
        is_cached: Callable[[Constraint], bool],
        threads: CompileThreads,
    ) -> None:
        self._compile_fn = compile_fn
        self._is_cached = is_cached
        self._threads = threads
        self._token = trio.lowlevel.current_trio_token()
        self._flights: dict[tuple[str | None, Constraint], _Flight] = {}
        self._compiled = self._shared = self._withdrawn = 0

    async def compile(self, constraint: Constraint, tenant: str | None = None) -> None:
        """Return once `constraint` is compiled and cached; its RequestError if it is bad.
        `tenant` (a name, None without tenants): whose turn on the compile thread it takes.

        Cancellation handling: the caller leaves at once; the compile is withdrawn if no
        other caller waits for it and no thread has taken it yet, else it goes on (and its
        grammar is cached for the next request).
        """
        if self._is_cached(constraint):
            return  # no thread, no wait behind another compile
        key = (tenant, constraint)
        flight = self._flights.get(key)
        if flight is None:
            flight = self._start(key)
        else:
            self._shared += 1
        flight.waiters += 1
        try:
            await flight.done.wait()
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.done.is_set():
                self._abandon(key, flight)
        if flight.error is not None:
            raise flight.error

    def _start(self, key: tuple[str | None, Constraint]) -> _Flight:
        flight = _Flight()
        self._flights[key] = flight
        tenant, constraint = key

        def on_done(job: CompileJob) -> None:  # on the compile thread
            try:
                self._token.run_sync_soon(self._finish, key, flight, job)
            except trio.RunFinishedError:
                pass  # the node is gone; nobody waits

        flight.job = CompileJob(lambda: self._compile_fn(constraint), on_done, lane=tenant)
        self._threads.submit(flight.job)
        return flight

    def _abandon(self, key: tuple[str | None, Constraint], flight: _Flight) -> None:
        assert flight.job is not None
        if flight.job.withdraw():
            self._withdrawn += 1
            flight.done.set()
            if self._flights.get(key) is flight:
                del self._flights[key]
        # else: running; it stays in flight, so a new caller joins it rather than compiling
        # the same schema a second time

    def _finish(self, key: tuple[str | None, Constraint], flight: _Flight, job: CompileJob) -> None:
        self._compiled += 1
        flight.error = job.error
        if job.error is not None and not isinstance(job.error, Exception):
            log.error("grammar compile: %s", job.error)  # a BaseException: handed on as is
        flight.done.set()
        if self._flights.get(key) is flight:
            del self._flights[key]

    def statistics(self) -> GrammarCompileStatistics:
        return GrammarCompileStatistics(
            len(self._flights), self._compiled, self._shared, self._withdrawn
        )

    def close(self) -> None:
        self._threads.close()


def new_compile_threads(model: str) -> CompileThreads:
    """The compile threads of one model: one, at the lowest scheduling priority
    (`compile_threads.COMPILE_NICE`), so that a schema compiles on what the engine's step
    leaves of the cores rather than slowing every step (a cache hit never waits for it)."""
    return CompileThreads(1, name=f"neuron-grammar-{model}")
