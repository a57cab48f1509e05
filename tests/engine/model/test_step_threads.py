"""The kernels' thread count follows the cores that other work leaves free (issue 47: with as
many threads as cores, one other busy thread made 2-core steps 10-50x slower). A fake
machine drives the decisions: its clock, the step thread's CPU time and /proc/stat's idle
time; nothing is timed."""

from __future__ import annotations

import torch

from neuron_trio.engine.model.step_threads import GAP_S, WINDOW_S, StepThreads, idle_seconds
from neuron_trio.engine.types import SamplingParams
from tests.engine.fake_runner import fake_engine, prompt_ids

STEP_S = 0.05
WINDOWS_2 = round(2 * WINDOW_S / STEP_S) + 1  # the steps of two windows


class Machine:
    """2 CPUs; `others` cores kept busy by work that is not the step's (a process, a thread)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 0.0  # the step thread's CPU time
        self.idle = 1000.0
        self.others = 0.0
        self.set_calls: list[int] = []
        self.threads = StepThreads(
            2,
            [0, 1],
            read_idle=lambda cpus: self.idle,
            clock=lambda: self.now,
            thread_clock=lambda: self.cpu,
            set_threads=self.set_calls.append,
        )

    def step(self, wall: float = STEP_S) -> int:
        """One step of `wall` seconds; the count it ran with."""
        with self.threads.forward() as team:
            # the team gets what the others leave, shared evenly between its threads
            share = min(float(team), 2.0 - self.others)
            self.cpu += wall * share / team
            self.idle += wall * max(0.0, 2.0 - self.others - team)
            self.now += wall
        return team

    def steps(self, seconds: float) -> list[int]:
        return [self.step() for _ in range(round(seconds / STEP_S))]


def test_every_thread_while_the_other_cores_are_idle() -> None:
    m = Machine()
    assert set(m.steps(3 * WINDOW_S)) == {2}
    assert set(m.set_calls) == {2}  # set on the step's thread, every step


def test_one_core_left_to_a_busy_neighbour_and_taken_back_once_it_is_idle() -> None:
    m = Machine()
    m.steps(WINDOW_S)
    m.others = 1.0  # a busy process, or the node's own event loop under a flood
    ran = m.steps(3 * WINDOW_S)
    # within two windows (the first may have begun before the neighbour did)
    assert ran[-1] == 1 and ran.count(2) <= WINDOWS_2
    assert m.set_calls[-1] == 1
    m.others = 0.0
    ran = m.steps(3 * WINDOW_S)
    assert ran[-1] == 2 and ran.count(1) <= WINDOWS_2


def test_a_light_neighbour_keeps_every_thread_and_a_pause_starts_a_new_window() -> None:
    m = Machine()
    m.others = 0.3  # well under half a core: the step keeps both
    assert set(m.steps(4 * WINDOW_S)) == {2}
    m.others = 1.0
    m.steps(WINDOW_S / 2)
    m.now += 10 * GAP_S  # idle node: the pause's idle time is no evidence either way
    m.idle += 10 * GAP_S * 2
    m.others = 0.0
    assert set(m.steps(2 * WINDOW_S)) == {2}


def test_no_change_without_proc_stat_or_with_one_cpu() -> None:
    calls: list[int] = []
    for cpus, reader in (([0, 1], lambda cpus: None), ([0], lambda cpus: 5.0)):
        threads = StepThreads(2, cpus, read_idle=reader, set_threads=calls.append)
        for _ in range(50):
            with threads.forward():
                pass
        assert threads.current == 2
    assert set(calls) == {2}


def test_idle_seconds_reads_the_processes_cpus() -> None:
    one = idle_seconds([0])
    assert one is not None and one >= 0
    both = idle_seconds([0, 1])
    assert both is not None and both >= one
    assert idle_seconds([]) == 0


def test_the_engine_runs_its_forwards_with_the_count_chosen() -> None:
    engine, runner = fake_engine()
    seen: list[int] = []
    forward = runner.forward

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    runner.forward = recording
    assert engine._threads is not None  # a CPU runner
    engine._threads.current = 1  # as after a window with a busy neighbour
    engine._threads.threads = 1
    before = torch.get_num_threads()
    try:
        engine.add(prompt_ids(6), SamplingParams(temperature=0.0, max_tokens=3), chat=False)
        while engine.has_work:
            engine.step()
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
