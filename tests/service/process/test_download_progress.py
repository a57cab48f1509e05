"""Download progress to systemd: STATUS= with bytes and percent, EXTEND_TIMEOUT_USEC= with
each report, at most one a second; end to end through huggingface_hub and a real socket."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from neuron_trio.service.process.download_progress import (
    LOAD_SILENCE_S,
    DownloadProgress,
    describe,
    reporting_tqdm,
)
from neuron_trio.service.process.notifier import Notifier
from tests.service.hub_server import GGUF_BYTES
from tests.service.node_world import FakeNotifier, World, make_config, run_world


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_describe() -> None:
    assert describe("m", 3 << 29, 4 << 30) == "downloading m: 1.5 GiB of 4.0 GiB (37%)"
    assert describe("m", 512, 1024) == "downloading m: 512 B of 1.0 KiB (50%)"
    assert describe("m", 5 << 20, None) == "downloading m: 5.0 MiB"


def test_reports_at_most_every_second_and_always_the_end() -> None:
    sink = FakeNotifier()
    clock = Clock()
    progress = DownloadProgress(sink, "m", clock=clock)
    progress(0, 1000)
    for done in range(100, 1000, 100):
        clock.now += 0.25  # exact in binary: no rounding at the 1 s edge
        progress(done, 1000)
    clock.now += 0.1
    progress(1000, 1000)
    assert [s for _, s in sink.extended] == [
        "downloading m: 0 B of 1000 B (0%)",
        "downloading m: 400 B of 1000 B (40%)",
        "downloading m: 800 B of 1000 B (80%)",
        "downloading m: 1000 B of 1000 B (100%)",
    ]
    assert {seconds for seconds, _ in sink.extended} == {LOAD_SILENCE_S}


def test_extend_timeout_datagram(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(5)
    try:
        n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})
        assert n.extend_timeout(300, "downloading m\n50%")
        assert listener.recv(4096).decode() == (
            "STATUS=downloading m 50%\nEXTEND_TIMEOUT_USEC=300000000"
        )
        n.close()
    finally:
        listener.close()


def test_reporting_tqdm_counts_bytes_and_draws_nothing_when_quiet() -> None:
    seen: list[tuple[int, int | None]] = []
    out = io.StringIO()
    bar = reporting_tqdm(lambda d, t: seen.append((d, t)), quiet=True)(
        total=100, initial=10, file=out
    )
    bar.update(40)
    bar.update(50)
    bar.close()
    assert seen == [(10, 100), (50, 100), (100, 100)]
    assert out.getvalue() == ""


def test_a_hub_download_reports_to_systemd(hub: str, tmp_path: Path) -> None:
    """huggingface_hub's own progress bar drives the reports (a fresh process: HF_* at import)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(30)
    code = textwrap.dedent(
        """
        from neuron_trio.config import config_from_mapping
        from neuron_trio.service.process.download_progress import DownloadProgress
        from neuron_trio.service.process.notifier import Notifier
        from neuron_trio.service.sources import resolve_source
        config = config_from_mapping({}, origin="test", environ={})
        progress = DownloadProgress(Notifier(), "tiny", every_s=0)
        print(resolve_source("hf:acme/tiny/tiny.Q4_0.gguf", config, on_bytes=progress))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=hub, HF_HOME=str(tmp_path / "hf"), NOTIFY_SOCKET=str(tmp_path / "notify")
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert Path(done.stdout.strip()).read_bytes() == GGUF_BYTES
        listener.setblocking(False)
        messages = []
        while True:
            try:
                messages.append(listener.recv(4096).decode())
            except BlockingIOError:
                break
    finally:
        listener.close()
    size = len(GGUF_BYTES)
    assert messages, "no report"
    assert all(m.startswith("STATUS=downloading tiny: ") for m in messages)
    assert all(m.endswith("\nEXTEND_TIMEOUT_USEC=300000000") for m in messages)
    assert messages[-1].startswith(
        f"STATUS=downloading tiny: {size / 1024:.1f} KiB of {size / 1024:.1f} KiB (100%)\n"
    )


def test_each_default_model_load_extends_the_start(tmp_path: Path) -> None:
    async def test(w: World) -> None:
        node = w.node(make_config(tmp_path))
        await w.nursery.start(node.run)
        assert w.notifier.extended == [(LOAD_SILENCE_S, "loading a (1/1) from a.gguf…")]

    run_world(tmp_path, test)
