"""The signal receiver: first signal drains, a second exits at once (killed by the signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import trio
import trio.testing

from neuron_trio.service.process.signals import SignalWatcher


def test_first_drains_second_exits() -> None:
    drains: list[int] = []
    hard: list[int] = []

    async def main() -> None:
        drained, stopped = trio.Event(), trio.Event()

        def on_first(sig: int) -> None:
            drains.append(sig)
            drained.set()

        def on_second(sig: int) -> None:
            hard.append(sig)
            stopped.set()

        watcher = SignalWatcher(on_first, on_second=on_second)
        async with trio.open_nursery() as nursery:
            await nursery.start(watcher.run)
            os.kill(os.getpid(), signal.SIGTERM)
            with trio.fail_after(10):
                await drained.wait()
            assert drains == [signal.SIGTERM] and not hard and watcher.draining
            os.kill(os.getpid(), signal.SIGINT)
            with trio.fail_after(10):
                await stopped.wait()
            assert hard == [signal.SIGINT] and drains == [signal.SIGTERM]
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_decision_without_trio() -> None:
    drains: list[int] = []
    hard: list[int] = []
    watcher = SignalWatcher(drains.append, on_second=hard.append)
    watcher.handle(signal.SIGINT)
    watcher.handle(signal.SIGTERM)
    watcher.handle(signal.SIGTERM)
    assert drains == [signal.SIGINT] and hard == [signal.SIGTERM, signal.SIGTERM]


def test_second_signal_kills_with_that_signal() -> None:
    # A real process: drain begins on the first SIGTERM, the second kills it by SIGTERM
    # even though the drain never ends.
    code = textwrap.dedent(
        """
        import os, signal, sys, trio
        from neuron_trio.service.process.signals import SignalWatcher

        async def main():
            drained = trio.Event()
            watcher = SignalWatcher(lambda sig: drained.set())
            async with trio.open_nursery() as nursery:
                await nursery.start(watcher.run)
                os.kill(os.getpid(), signal.SIGTERM)
                await drained.wait()
                print("draining", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                await trio.sleep_forever()

        trio.run(main)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "draining\n"
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "exiting now" in proc.stderr
