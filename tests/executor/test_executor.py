"""The executor on a tiny random GGUF model (6 heads / 3 KV heads): tp = 1 and tp = 3 on CPU,
a wedged collective aborted and the communicator re-created, the failpoints it honours."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from neuron_trio.config import ModelConfig
from neuron_trio.engine.engine import PREFILL_CHUNK
from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.load_phases import LoadPhases
from neuron_trio.engine.model.load.weight_cache import WeightCache
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.types import Constraint, SamplingParams
from neuron_trio.errors import CommAbortedError, ConfigError, FailpointError
from neuron_trio.executor.api import RankInfo
from neuron_trio.executor.executor import CachedMerges, Executor, build_executor
from neuron_trio.executor.tp.inprocess import InProcessCommunicator
from tests.engine.tiny_families import write_tiny_family
from tests.engine.tiny_gguf import write_tiny_llama
from tests.executor.tp.threaded import TIMEOUT, SignallingFailpoints, Worker

CPU = [torch.device("cpu")]
PROMPTS = [[5, 70, 80, 90, 100], [7, 8, 9]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return write_tiny_llama(path, n_layers=2, dim=96, n_heads=6, n_kv_heads=3, ffn_dim=192)


def _spec(tp: int, dtype: str = "float32") -> ModelConfig:
    return ModelConfig(name="tiny", source="tiny.gguf", tp=tp, dtype=dtype, max_batch=2, context=64)  # type: ignore[arg-type]


def _generate(executor: Executor, prompts: list[list[int]], n: int = 6) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids = [executor.engine.add(p, params, chat=False) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while executor.engine.has_work:
        for event in executor.step():
            out[event.seq_id].extend(event.token_ids)
    return [out[i] for i in ids]


def _build(tiny: Path, tp: int, spec: str = "") -> tuple[Executor, SignallingFailpoints]:
    failpoints = SignallingFailpoints(spec)
    failpoints.configure(failpoints.configured)  # disarmed while loading, as in the daemon
    executor = build_executor(_spec(tp), tiny, CPU, failpoints=failpoints)
    failpoints.arm()
    return executor, failpoints


def test_tp1(tiny: Path) -> None:
    executor, _ = _build(tiny, 1)
    assert executor.tp == 1 and executor.comm is None
    assert executor.ranks == [RankInfo(device="cpu", heads=6, kv_heads=3)]
    assert executor.dtype == "float32"
    executor.abort_comm()  # nothing to abort
    executor.recreate_comm()
    assert all(len(t) == 6 for t in _generate(executor, PROMPTS))
    executor.probe()
    executor.close()
    executor.close()


def test_tp3_matches_tp1_and_reports_its_ranks(tiny: Path) -> None:
    one, _ = _build(tiny, 1)
    three, _ = _build(tiny, 3)
    assert three.tp == 3
    assert isinstance(three.comm, InProcessCommunicator)
    assert three.ranks == [RankInfo(device="cpu", heads=2, kv_heads=1)] * 3
    assert three.comm.describe()["kind"] == "in-process"
    assert _generate(three, PROMPTS) == _generate(one, PROMPTS)


def test_tp_that_does_not_divide_the_heads_is_a_config_error(tiny: Path) -> None:
    with pytest.raises(ConfigError, match="tp = 2 does not divide 6 attention heads / 3 KV heads"):
        build_executor(_spec(2), tiny, CPU)


def test_wedged_collective_abort_recreate_probe_serve(tiny: Path) -> None:
    executor, failpoints = _build(tiny, 3, "tp.allreduce=hang")
    expected = _generate(_build(tiny, 3)[0], PROMPTS[:1])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    executor.engine.add(PROMPTS[0], params, chat=False)
    step = Worker(executor.step, "step")
    assert failpoints.reached["tp.allreduce"].wait(TIMEOUT)
    assert not step.done.wait(0.05)
    abort = Worker(executor.abort_comm, "nccl-abort")
    abort.join()
    step.join()
    assert abort.error is None
    assert isinstance(step.error, CommAbortedError)
    executor.engine.cancel_all()
    old = executor.comm
    executor.recreate_comm()
    assert executor.comm is not old
    assert executor.runner.comm is executor.comm
    executor.probe()
    assert _generate(executor, PROMPTS[:1]) == expected  # serves again, same tokens


def test_abort_error_comes_back_and_the_communicator_is_recreated(tiny: Path) -> None:
    executor, failpoints = _build(tiny, 3, "tp.allreduce=hang;tp.abort=error")
    executor.engine.add(PROMPTS[1], SamplingParams(max_tokens=2, temperature=0.0), chat=False)
    step = Worker(executor.step, "step")
    assert failpoints.reached["tp.allreduce"].wait(TIMEOUT)
    with pytest.raises(FailpointError):
        executor.abort_comm()
    step.join()
    assert isinstance(step.error, CommAbortedError)
    executor.engine.cancel_all()
    executor.recreate_comm()
    executor.probe()


def test_engine_step_hang_blocks_the_step_for_ever_with_tp1(tiny: Path) -> None:
    executor, failpoints = _build(tiny, 1, "engine.step=hang")
    step = Worker(executor.step, "step")  # a daemon thread, left blocked
    assert failpoints.reached["engine.step"].wait(TIMEOUT)
    executor.abort_comm()  # returns at once: nothing to abort
    assert not step.done.wait(0.1)


def test_engine_step_error(tiny: Path) -> None:
    executor, _ = _build(tiny, 1, "engine.step=error")
    with pytest.raises(FailpointError):
        executor.step()
    assert executor.step() == []  # fired once; nothing to do


def test_rank_devices_and_communicator_kinds() -> None:
    from neuron_trio.executor.executor import _rank_devices, make_comm_factory

    assert _rank_devices(CPU, 3) == CPU * 3
    with pytest.raises(ConfigError):
        _rank_devices(CPU * 2, 3)
    assert isinstance(make_comm_factory(CPU * 3)(), InProcessCommunicator)
    with pytest.raises(ConfigError, match="mixed"):
        make_comm_factory([torch.device("cpu"), torch.device("cuda", 0)])


@pytest.mark.parametrize("tp", [1, 3])
def test_one_builder_sizes_every_tp_the_same(tiny: Path, tp: int) -> None:
    spec = ModelConfig(
        name="tiny", source="tiny.gguf", tp=tp, dtype="float32", max_batch=1, context=1000
    )
    executor = build_executor(spec, tiny, CPU)
    assert executor.engine.context == 256  # capped at the tiny file's context_length
    assert executor.runner.context == 256
    # the pool: max_batch x 256 tokens in blocks of 16, plus the null and probe blocks
    assert executor.runner.blocks == 256 // 16 + 2
    assert executor.engine.prefill_chunk == PREFILL_CHUNK


def test_tp3_forks_n_choices_and_masks_the_gathered_logits(tiny: Path) -> None:
    """n = 2 forks every rank's K/V rows; a grammar masks the logits all ranks computed."""
    schema = '{"enum":["yes","no"]}'
    outputs = []
    for tp in (1, 3):
        executor, _ = _build(tiny, tp)
        engine = executor.engine
        params = SamplingParams(
            max_tokens=8, temperature=0.0, n=2, constraint=Constraint("json", schema=schema)
        )
        seq_id = engine.add(PROMPTS[0], params, chat=False)
        texts: dict[int, str] = {0: "", 1: ""}
        while engine.has_work:
            for event in executor.step():
                assert event.seq_id == seq_id
                texts[event.index] += event.text
        outputs.append(texts)
        plain = _generate(executor, PROMPTS, n=4)
        assert plain == _generate(executor, PROMPTS, n=4)  # forked slots left nothing behind
    assert outputs[0] == outputs[1]
    assert outputs[0][0] == outputs[0][1] and outputs[0][0] in ('"yes"', '"no"'), outputs


def test_the_start_up_phases_are_logged_once_after_the_warm_up(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = WeightCache(tmp_path / "cache", 1 << 30, background=False)
    with caplog.at_level(logging.INFO, logger="neuron_trio.executor.executor"):
        for _ in range(2):  # the first load packs and stores, the second maps the entry
            executor = build_executor(_spec(1, "auto"), tiny, CPU, weight_cache=cache)
            executor.probe()
            executor.warm_up()
            executor.warm_up()  # a later warm-up (none in the daemon) logs nothing more
            executor.close()
    lines = [r.getMessage() for r in caplog.records if "start-up phases" in r.getMessage()]
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("model tiny: start-up phases: ")
        total, _, phases = line.removeprefix("model tiny: start-up phases: ").partition(": ")
        names = [part.rsplit(" ", 1)[0] for part in phases.split(";")[0].split(", ")]
        assert total.endswith(" s") and names[0] == "parse" and names[-1] == "warm-up"
        assert {"tokenizer", "kv pool", "first forward"} <= set(names)
    if packing.int4_available():  # "auto" is cpu-int: the cache is used
        assert "dequantize" in lines[0] and "pack " in lines[0] and "pack " not in lines[1]
        assert "weight cache miss: stored" in lines[0] and "weight cache hit" in lines[1]


def test_the_tokenizer_is_built_beside_the_weights_load(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on a thread of its own, running while the load runs (the load waits for it to finish:
    # the tokenizer must be started before the load ends, and end after the load began)
    from neuron_trio.executor import executor as executor_module

    seen: dict[str, tuple[str, float, float]] = {}
    load_began = threading.Event()

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            if name == "load":
                load_began.set()
            else:  # a tiny vocabulary builds in milliseconds: end after the load began
                load_began.wait(10)
            out = fn(*args, **kwargs)
            seen[name] = (threading.current_thread().name, started, time.perf_counter())
            return out

        return run

    monkeypatch.setattr(
        executor_module.Tokenizer, "from_gguf", timed("tokenizer", Tokenizer.from_gguf)
    )
    monkeypatch.setattr(
        executor_module, "load_transformer", timed("load", executor_module.load_transformer)
    )
    executor = build_executor(_spec(1, "auto"), tiny, CPU)
    executor.close()
    (tok_thread, tok_start, tok_end), (load_thread, load_start, load_end) = (
        seen["tokenizer"],
        seen["load"],
    )
    assert tok_thread != load_thread
    assert tok_start < load_end and load_start < tok_end
    assert any("tokenizer built beside the weights" in n for n in executor_notes(executor))


def executor_notes(executor: Executor) -> tuple[str, ...]:
    phases = executor.load_phases
    assert phases is not None
    return phases.statistics().notes


def test_derived_merges_are_kept_in_the_weight_cache(tmp_path: Path) -> None:
    # a SentencePiece vocabulary without merges: the first start derives them from the
    # scores and stores them, the next reads them back (and tokenizes the same)
    path = write_tiny_family(tmp_path / "spm.gguf", "mistral")
    cache = WeightCache(tmp_path / "cache", 1 << 30, background=False)
    texts = ["hello world", "the quick brown fox", "  spaces  and\nlines"]
    encoded, notes = [], []
    for _ in range(2):
        executor = build_executor(_spec(1, "auto"), path, CPU, weight_cache=cache)
        tokenizer = executor.engine.tokenizer
        encoded.append([tokenizer.encode(t, add_special_tokens=False) for t in texts])
        notes.append(executor.load_phases.statistics().notes)
        executor.close()
    assert encoded[0] == encoded[1] and any(encoded[0])
    assert not any("merges" in n for n in notes[0])
    assert any("tokenizer merges from the weight cache" in n for n in notes[1])
    assert len(list((tmp_path / "cache").glob("merges-*"))) == 1


def test_cached_merges_round_trip_and_a_corrupt_entry_is_a_miss(tmp_path: Path) -> None:
    cache = WeightCache(tmp_path, 1 << 30, background=False)
    store = CachedMerges(cache, LoadPhases())
    assert store.get("k") is None
    pairs = np.array([[3, 4], [5, 6], [7, 8]], dtype=np.int32)
    store.put("k", pairs)
    got = store.get("k")
    assert got is not None and got.tolist() == pairs.tolist()
    (entry,) = tmp_path.glob("merges-k*")
    data = bytearray(entry.read_bytes())
    at = data.find(pairs.tobytes())
    assert at > 0
    data[at] ^= 0xFF  # one of the pairs' bytes: the checksum no longer matches
    entry.write_bytes(bytes(data))
    assert store.get("k") is None
    assert not entry.exists()  # removed: the next start derives and stores again
