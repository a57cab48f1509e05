"""`Executor`: one loaded model: its engine, rank models, devices and communicator.

Everything here is synchronous and may block; the service layer calls it from worker threads
(`trio.to_thread.run_sync`) with its own deadlines and limiters:

- `step()` / `probe()`: one engine step / one tiny forward; block their thread for a step
  (for ever if a collective wedges, until `abort_comm()` unblocks them).
- `abort_comm()`: `ncclCommAbort` on every rank; may block for ever itself, so it runs on a
  thread of its own under the abort deadline.
- `recreate_comm()`, `close()`: NCCL init and destroy; may block too.

None of these may run on an event loop thread: a blocked NCCL call would take the loop with
it. With `tp = 1` there is no communicator: `abort_comm()` and `recreate_comm()` do nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from neuron_trio import failpoints as fp
from neuron_trio.config import ModelConfig
from neuron_trio.engine.c_heap import release_freed_heap
from neuron_trio.engine.engine import PREFILL_CHUNK, Engine
from neuron_trio.engine.gguf import header_memo
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.engine.model.load.load_phases import LoadPhases
from neuron_trio.engine.model.load.loader import SingleRunner, load_transformer
from neuron_trio.engine.model.load.sizing import EngineSizing, engine_sizing
from neuron_trio.engine.model.load.weight_cache import WeightCache
from neuron_trio.engine.model.runner import Runner
from neuron_trio.engine.model.transformer import Transformer
from neuron_trio.engine.speculation.draft_model import DraftModel, load_draft
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.types import SequenceEvent
from neuron_trio.engine.warm_up import WarmUpReport, warm_up
from neuron_trio.errors import CommError, ConfigError
from neuron_trio.executor.api import ModelExecutor, RankInfo
from neuron_trio.executor.comm import Communicator
from neuron_trio.executor.tp.runner import TPRunner
from neuron_trio.executor.tp.sharding import check_tp, rank_shapes, shard_fn

log = logging.getLogger(__name__)

CommFactory = Callable[[], Communicator]
# The most `close` waits for a packed-weight cache entry being written (1.85 GB took ~7 s on a
# busy 2-core machine): well inside a drain's and systemd's stop timeouts.
WEIGHT_CACHE_WRITE_WAIT_S = 60.0


class Executor:
    """Owns the engine and what it runs on; its methods are meant for worker threads."""

    def __init__(
        self,
        *,
        engine: Engine,
        models: list[Transformer],
        devices: list[torch.device],
        comm: Communicator | None,
        comm_factory: CommFactory | None,
        dtype: str,
        ranks: list[RankInfo],
        failpoints: fp.Failpoints | None = None,
        name: str = "",
        load_phases: LoadPhases | None = None,
        weight_cache: WeightCache | None = None,
    ) -> None:
        self.name = name
        self._weight_cache = weight_cache  # close() lets its writes finish
        # the build's phases; the first probe and the warm-up add theirs, then it is logged
        self.load_phases = load_phases
        self.engine = engine
        self.models = models
        self.devices = devices
        self.comm = comm
        self._comm_factory = comm_factory
        self.dtype = dtype
        self.ranks = ranks
        self.tp = len(models)
        self._failpoints = fp.REGISTRY if failpoints is None else failpoints
        self._lock = threading.Lock()  # recreate/close against each other
        self.closed = False

    @property
    def runner(self) -> Runner:
        return self.engine.runner

    def step(self) -> list[SequenceEvent]:
        """The `engine.step` failpoint (hang: for ever), then one engine step."""
        self._failpoints.reach("engine.step")
        return list(self.engine.step())

    def probe(self) -> None:
        """One tiny forward on the scratch KV row; touches no sequence."""
        phases = self.load_phases
        if phases is None:
            self.engine.probe()
            return
        with phases.phase("first forward"):
            self.engine.probe()

    def warm_up(self) -> WarmUpReport:
        """A few tiny requests through the engine (`engine.warm_up`), before serving, so that
        the first request pays no one-time cost. Blocks like a few steps. Then logs where the
        start-up time went (once: `load_phases`)."""
        phases, self.load_phases = self.load_phases, None
        if phases is None:
            return warm_up(self.engine)
        with phases.phase("warm-up"):
            report = warm_up(self.engine)
        log.info("model %s: start-up phases: %s", self.name, phases.summary())
        # A load frees much of what it allocated (the tokenizer's temporary tables, dequantised
        # weights, the warm-up's buffers) and glibc keeps freed pages mapped: Gemma 3 270M is
        # ready with ~24 MB less resident, Qwen2.5 0.5B ~18 MB.
        release_freed_heap()
        return report

    def abort_comm(self) -> None:
        """Abort the communicator (unblocks a wedged step with CommAbortedError).

        May block for ever (NCCL's abort can hang): call it on a thread of its own. With
        `tp = 1`, nothing to abort: returns at once.
        """
        comm = self.comm
        if comm is not None:
            comm.abort()

    def recreate_comm(self) -> None:
        """Destroy (or, if that fails, drop) the old communicator; init a new one; rebind.

        Blocks (NCCL init and destroy); raises CommError if the new one cannot be made.
        """
        with self._lock:
            if self.comm is None or self._comm_factory is None:
                return
            old, self.comm = self.comm, None
            try:
                old.destroy()  # a no-op after a real abort (the handles are already freed)
            except Exception as exc:
                log.warning("dropping the old communicator: destroy failed: %s", exc)
            try:
                new = self._comm_factory()
            except BaseException:
                self.comm = old  # aborting it again is harmless; a step must not see None
                raise
            runner = self.runner
            assert isinstance(runner, TPRunner)  # a communicator exists only with tp > 1
            runner.rebind(new)
            self.comm = new

    def close(self) -> None:
        """Cancel every sequence, destroy the communicator, free the models. May block."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.engine.cancel_all()
            except Exception as exc:
                log.warning("cancel_all on close failed: %s", exc)
            comm, self.comm = self.comm, None
            if comm is not None:
                try:
                    comm.destroy()
                except Exception as exc:
                    log.warning("destroying the communicator on close failed: %s", exc)
            self.models = []
            if any(d.type == "cuda" for d in self.devices) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            cache = self._weight_cache
            # a packed-weight cache entry still being written: a stop right after a cold
            # start would otherwise lose it, and the next start would pack again
            if cache is not None and not cache.wait_for_writes(WEIGHT_CACHE_WRITE_WAIT_S):
                log.warning("model %s: the weight cache entry was not written in time", self.name)


def _rank_devices(devices: list[torch.device], tp: int) -> list[torch.device]:
    if len(devices) == tp:
        return list(devices)
    if len(devices) == 1:
        # CPU ranks; or several ranks on one GPU (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1).
        return list(devices) * tp
    raise ConfigError(f"tp = {tp} needs {tp} devices (or one), got {len(devices)}")


def make_comm_factory(
    devices: list[torch.device], failpoints: fp.Failpoints | None = None
) -> CommFactory:
    """How to (re-)create the communicator of these rank devices: NCCL or in-process."""
    if all(d.type == "cuda" for d in devices):

        def nccl() -> Communicator:
            from neuron_trio.executor.tp.nccl_comm import NcclCommunicator

            return NcclCommunicator.init_all(devices, failpoints=failpoints)

        return nccl
    if all(d.type == "cpu" for d in devices):

        def in_process() -> Communicator:
            from neuron_trio.executor.tp.inprocess import InProcessCommunicator

            return InProcessCommunicator(len(devices), devices, failpoints=failpoints)

        return in_process
    raise ConfigError(f"tensor parallelism over {[str(d) for d in devices]}: mixed device types")


class CachedMerges:
    """A tokenizer's merges derived from scores (SentencePiece vocabularies without merges:
    Gemma, Llama 2), kept in the packed-weight cache as int32 token-id pairs
    (gguf_vocab.MergesStore): a warm start of Gemma 3 270M reads them instead of ~1 s of
    deriving. Its entries are small (Gemma 3: 4 MB) and evicted with the rest."""

    def __init__(self, cache: WeightCache, phases: LoadPhases) -> None:
        self.cache = cache
        self.phases = phases

    def get(self, key: str) -> np.ndarray | None:
        pairs = self.cache.load_array(f"merges-{key}")
        if pairs is None:
            return None
        self.phases.note("tokenizer merges from the weight cache")
        return pairs.numpy()

    def put(self, key: str, pairs: np.ndarray) -> None:
        self.cache.store_array(f"merges-{key}", torch.from_numpy(pairs))


def build_executor(
    spec: ModelConfig,
    model_path: str | Path,
    devices: list[torch.device],
    *,
    failpoints: fp.Failpoints | None = None,
    weight_cache: WeightCache | None = None,
    draft_path: str | Path | None = None,
) -> Executor:
    """Load `model_path` as `spec` says (tp ranks over `devices`) and build its engine.
    `draft_path`: the file of `spec.speculative.source` (method "draft"), already resolved.

    Slow (reads and converts every weight, `tp` times) and blocking: call it on a worker
    thread. With `tp > 1` on CUDA this initialises NCCL, which may block too. Raises
    ConfigError if `tp` does not split the model, ModelLoadError if it cannot be loaded,
    CommError (NcclError) if the communicator cannot be made. `weight_cache`: where packed
    weights are kept between loads (tp = 1 on the CPU under "auto"; `loader.load_transformer`).
    """
    failpoints = fp.REGISTRY if failpoints is None else failpoints
    tp = spec.tp
    rank_devices = _rank_devices(devices, tp)
    phases = LoadPhases()
    # One mapping for every rank's load; with tp > 1 each weight is dequantised once and
    # sliced per rank (dequantising is most of a load's time).
    with phases.phase("parse"):
        gguf = _SharedWeights(model_path) if tp > 1 else GGUFFile(model_path)
    with gguf:
        config = gguf.config
        try:
            check_tp(config, tp)
        except ConfigError as exc:
            raise ConfigError(f"model {spec.name!r}: {exc}") from None
        sizing = engine_sizing(
            config,
            spec.dtype,
            rank_devices[0],
            kv_cache_mb=spec.kv_cache_mb,
            max_batch=spec.max_batch,
            context=spec.context,
        )
        # The tokenizer is built beside the weights' load: most of that load (a packed-weight
        # cache hit's read, torch's work) runs without the GIL, most of the tokenizer's
        # build (Rust in `tokenizers`) with it; Gemma 3's restart: ~1.2 s and ~0.4 s.
        with ThreadPoolExecutor(1, thread_name_prefix="neuron-tokenizer") as beside:
            building = beside.submit(_build_tokenizer, gguf, weight_cache, phases)
            models = _load_ranks(gguf, spec, rank_devices, weight_cache, phases)
            with phases.phase("tokenizer"):  # what the load waited for it (the log's sum)
                tokenizer = building.result()
    header_memo.MEMO.clear()  # the last of the start's opens of this file (engine.gguf.header_memo)
    runner, comm, factory = _make_runner(models, config, sizing, rank_devices, failpoints, phases)
    draft = _draft_model(spec, draft_path, tokenizer, sizing.context, rank_devices[0], phases)
    with phases.phase("engine"):
        engine = Engine(
            runner,
            tokenizer,
            max_batch=spec.max_batch,
            context=sizing.context,
            prefill_chunk=PREFILL_CHUNK,
            prefix_cache=spec.prefix_cache,
            tool_call_format=spec.tool_call_format,
            speculative_tokens=spec.speculative.num_tokens if spec.speculative else 0,
            draft=draft,
        )
    return Executor(
        name=spec.name,
        load_phases=phases,
        weight_cache=weight_cache if tp == 1 else None,
        engine=engine,
        models=models,
        devices=rank_devices,
        comm=comm,
        comm_factory=factory,
        dtype=models[0].scheme,
        ranks=_ranks(config, rank_devices),
        failpoints=failpoints,
    )


def _build_tokenizer(
    gguf: GGUFFile, weight_cache: WeightCache | None, phases: LoadPhases
) -> Tokenizer:
    """The file's tokenizer (its derived merges kept in `weight_cache`), on a thread of its
    own beside the weights' load: its time is a note, what the load waited for it a phase."""
    started = time.perf_counter()
    store = None if weight_cache is None else CachedMerges(weight_cache, phases)
    tokenizer = Tokenizer.from_gguf(gguf, merges_store=store)
    phases.note(f"tokenizer built beside the weights in {time.perf_counter() - started:.2f} s")
    return tokenizer


def _load_ranks(
    gguf: GGUFFile,
    spec: ModelConfig,
    rank_devices: list[torch.device],
    weight_cache: WeightCache | None,
    phases: LoadPhases,
) -> list[Transformer]:
    """Each rank's part of the model (the whole model at tp = 1, the only case the packed-weight
    cache serves)."""
    tp = spec.tp
    return [
        load_transformer(
            gguf,
            dtype=spec.dtype,
            device=rank_devices[rank],
            shard=shard_fn(gguf.config, rank, tp) if tp > 1 else None,
            tp=tp,
            weight_cache=weight_cache if tp == 1 else None,
            phases=phases,
        )
        for rank in range(tp)
    ]


def _draft_model(
    spec: ModelConfig,
    draft_path: str | Path | None,
    tokenizer: Tokenizer,
    context: int,
    device: torch.device,
    phases: LoadPhases,
) -> DraftModel | None:
    """The draft model of `spec`'s speculation (method "draft"), whole on the first rank's
    device (not split under tp); ConfigError naming both sources if its vocabulary is not
    the target's."""
    speculative = spec.speculative
    if speculative is None or speculative.method != "draft":
        return None
    if draft_path is None:
        raise ConfigError(f"model {spec.name!r}: speculative draft {speculative.source!r}: no file")
    with phases.phase("draft"):
        return load_draft(
            draft_path,
            tokenizer.tokens,
            dtype=spec.dtype,
            device=device,
            context=context,
            names=(spec.source, speculative.source or ""),
        )


def _make_runner(
    models: list[Transformer],
    config: LlamaConfig,
    sizing: EngineSizing,
    rank_devices: list[torch.device],
    failpoints: fp.Failpoints,
    phases: LoadPhases,
) -> tuple[Runner, Communicator | None, CommFactory | None]:
    """The runner over the loaded ranks' models (of the whole model's `config`), with its
    communicator and the factory that remakes it (both None for tp = 1)."""
    if len(models) == 1:
        with phases.phase("kv pool"):
            return (
                SingleRunner(models[0], blocks=sizing.kv_blocks, context=sizing.context),
                None,
                None,
            )
    factory = make_comm_factory(rank_devices, failpoints)
    comm = factory()
    try:
        runner = TPRunner(
            models, comm, blocks=sizing.kv_blocks, context=sizing.context, config=config
        )
    except BaseException:
        _destroy_quietly(comm)
        raise
    return runner, comm, factory


def _ranks(config: LlamaConfig, rank_devices: list[torch.device]) -> list[RankInfo]:
    shapes = rank_shapes(config, len(rank_devices))
    return [RankInfo(device=str(d), **shape) for d, shape in zip(rank_devices, shapes, strict=True)]


class _SharedWeights(GGUFFile):
    """A GGUF file whose weights are dequantised once and reused by every rank's load.

    Holds the whole model in float32 until closed; shards are copies (sharding.shard_fn), and
    replicated tensors are read-only, so sharing them between ranks is safe.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._weights: dict[str, torch.Tensor] = {}

    def weight(self, name: str) -> torch.Tensor:
        w = self._weights.get(name)
        if w is None:
            w = self._weights[name] = super().weight(name)
        return w

    def close(self) -> None:
        self._weights.clear()
        super().close()


def _destroy_quietly(comm: Communicator) -> None:
    try:
        comm.destroy()
    except CommError as exc:
        log.warning("destroying a communicator after a failed load: %s", exc)


if TYPE_CHECKING:
    # mypy checks the real class against the one protocol the service layer uses.
    _: type[ModelExecutor] = Executor
