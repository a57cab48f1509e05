"""The `neuron` command: usage errors (64), gpus --json, check-config, pull, serve wiring."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from neuron_trio import cli
from neuron_trio.config import NeuronConfig
from neuron_trio.errors import SourceError
from tests.gpu.fake_nvml import FakeNvml

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_failpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEURON_FAILPOINTS", raising=False)


@pytest.mark.parametrize(
    "argv",
    [
        ["frobnicate"],
        ["--bogus"],
        ["pull"],
        ["check-config"],
        ["serve", "--listen", "nohost"],
        ["gpus", "--timeout", "soon"],
    ],
)
def test_bad_usage_is_64(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 64
    out, err = capsys.readouterr()
    assert out == "" and "usage: neuron" in err


def test_help_is_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    assert "check-config" in capsys.readouterr().out


def test_gpus_json_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    # This machine has no driver: the real pynvml says so, and the exit is 0.
    assert cli.main(["gpus", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["available"] is False and doc["gpus"] == [] and doc["reason"]
    assert "nccl" in doc
    assert "no GPU/driver" in err


def test_gpus_with_fake_nvml(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(2))
    monkeypatch.setattr(
        cli, "nccl_status", lambda: {"version": "2.32.3", "library": "/x/libnccl.so.2"}
    )
    assert cli.main(["gpus", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [g["uuid"] for g in doc["gpus"]] == ["GPU-00000000", "GPU-00000001"]
    assert doc["driver_version"] == "550.54.15" and doc["cuda_version"] == "12.4"
    assert doc["nccl"] == {"version": "2.32.3", "library": "/x/libnccl.so.2"}
    assert cli.main(["gpus"]) == 0
    text = capsys.readouterr().out
    assert "GPU 1: NVIDIA H200 GPU-00000001" in text and "NCCL: version 2.32.3" in text


def test_gpus_hanging_nvml_is_69(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeNvml(1)
    fake.hang = threading.Event()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    try:
        assert cli.main(["gpus", "--json", "--timeout", "0.05"]) == 69
    finally:
        fake.hang.set()
    assert json.loads(capsys.readouterr().out)["error"] == "timed out after 0.05s"


def test_nccl_import_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "neuron_trio.executor.tp.nccl_lib", None)
    assert "error" in cli.nccl_status()


def test_gpus_json_subprocess_stdout_is_one_document() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_trio.cli", "gpus", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # raises if anything else is on stdout
    assert {"gpus", "nccl", "available"} <= set(doc)


def test_check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[server]\nlisten = ["127.0.0.1:9000"]\n')
    assert cli.main(["check-config", "--config", str(good)]) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nlisten_on = 1\n")
    capsys.readouterr()
    assert cli.main(["check-config", "--config", str(bad)]) == 78
    out, err = capsys.readouterr()
    assert out == "" and f"{bad}: key server.listen_on: unknown key" in err


def test_check_config_checks_failpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.toml"
    good.write_text("")
    monkeypatch.setenv("NEURON_FAILPOINTS", "tp.abort=maybe")
    assert cli.main(["check-config", "--config", str(good)]) == 78
    assert "NEURON_FAILPOINTS" in capsys.readouterr().err


def test_serve_passes_config_and_listen(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from neuron_trio import daemon

    seen: list[NeuronConfig] = []

    def fake_run(config: NeuronConfig) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(daemon, "run", fake_run)
    path = tmp_path / "n.toml"
    path.write_text("[tp]\nstep_timeout_s = 3\n")
    assert cli.main(["--config", str(path)]) == 0
    assert cli.main(["serve", "--config", str(path), "--listen", "127.0.0.1:9"]) == 0
    # A non-loopback --listen without api_key_file in the config: refused (78), not served.
    assert cli.main(["serve", "--listen", "[::1]:1", "--listen", "0.0.0.0:2"]) == 78
    assert len(seen) == 2
    open_path = tmp_path / "open.toml"
    open_path.write_text("[server]\nallow_unauthenticated = true\n")
    args = ["serve", "--config", str(open_path), "--listen", "[::1]:1", "--listen", "0.0.0.0:2"]
    assert cli.main(args) == 0
    assert seen[0].watchdog.step_timeout_s == 3 and seen[0].source_path == str(path)
    assert seen[1].server.listen == ["127.0.0.1:9"] and seen[1].watchdog.step_timeout_s == 3
    assert seen[2].server.listen == ["[::1]:1", "0.0.0.0:2"]


def test_serve_bad_config_is_78(tmp_path: Path) -> None:
    path = tmp_path / "n.toml"
    path.write_text("[tp\n")
    assert cli.main(["serve", "--config", str(path)]) == 78


def test_pull(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from neuron_trio.service import sources

    calls: list[tuple[str, Any]] = []

    def fake_pull(source: str, config: NeuronConfig) -> Path:
        calls.append((source, config))
        if source == "hf:nope/x.gguf":
            raise SourceError("hf:nope/x.gguf: repository not found")
        return Path("/cache/x.gguf")

    monkeypatch.setattr(sources, "pull", fake_pull)
    assert cli.main(["pull", "hf:org/repo/x.gguf"]) == 0
    assert capsys.readouterr().out == "/cache/x.gguf\n"
    assert cli.main(["pull", "hf:nope/x.gguf"]) == 69
    out, err = capsys.readouterr()
    assert out == "" and "repository not found" in err


def test_logging_setup() -> None:
    cli.setup_logging({"NEURON_LOG_LEVEL": "debug"})
    assert logging.getLogger().level == logging.DEBUG
    cli.setup_logging({"NEURON_LOG_LEVEL": "chatty"})
    assert logging.getLogger().level == logging.INFO
    cli.setup_logging({})


def test_single_line_records() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "failed\nbadly", None, sys.exc_info()
        )
    plain = cli.SingleLineFormatter(journal=False).format(record)
    assert "\n" not in plain and "failed | badly" in plain and "ValueError: boom" in plain
    journal = cli.SingleLineFormatter(journal=True).format(record)
    assert journal.startswith("<3>x: failed")
