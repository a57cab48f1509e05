"""What the service layer may ask of a loaded model: `ModelExecutor` and its `ServingEngine`.

One description of `executor.executor.Executor`, used by the model actor and the watchdog,
and checked against the real class by mypy (`executor.py` assigns the class to this
protocol's type). Tests pass fakes that satisfy it too. No torch here: the service layer
imports this module at start-up.

The executor's methods block (NCCL calls, forwards): call them on worker threads only.

It is also the engine's one face to the service (tests/test_layers.py forbids service/ every
other engine or executor module): the engine's plain vocabulary re-exported below, and small
functions that import the heavy parts (torch, the loader) only when called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from neuron_trio import failpoints as fp
from neuron_trio.config import ModelConfig
from neuron_trio.engine.block_pool import BLOCK_TOKENS
from neuron_trio.engine.c_heap import heap_free_bytes, limit_arenas, release_freed_heap
from neuron_trio.engine.fair_share import FairShare
from neuron_trio.engine.gguf import header_memo
from neuron_trio.engine.gguf.builtin import builtin_model_path
from neuron_trio.engine.kv_events import (
    DEFAULT_CAPACITY,
    AllClearedRecord,
    BlockRemovedRecord,
    BlockStoredRecord,
    KVEventLog,
    KVEventRecord,
)
from neuron_trio.engine.prompt import PreparedPrompt
from neuron_trio.engine.text.chat_probe import probe_gguf_chat_template
from neuron_trio.engine.text.native_errors import panics_as_model_file_errors
from neuron_trio.engine.text.structured.compile_threads import CompileJob, CompileThreads
from neuron_trio.engine.types import (
    GOOD_FINISH_REASONS,
    Constraint,
    EngineStatistics,
    SamplingParams,
    SequenceEvent,
    TokenLogprob,
    ToolCall,
    ToolFunction,
)

if TYPE_CHECKING:
    import torch

    from neuron_trio.engine.model.load.weight_cache import WeightCache
    from neuron_trio.engine.text.tokenizer import Tokenizer
    from neuron_trio.executor.comm import Communicator

__all__ = [
    "BLOCK_TOKENS",
    "DEFAULT_CAPACITY",
    "GOOD_FINISH_REASONS",
    "AllClearedRecord",
    "BlockRemovedRecord",
    "BlockStoredRecord",
    "CompileJob",
    "CompileThreads",
    "Constraint",
    "EngineStatistics",
    "FairShare",
    "KVEventLog",
    "KVEventRecord",
    "ModelExecutor",
    "PreparedPrompt",
    "RankInfo",
    "SamplingParams",
    "SequenceEvent",
    "ServingEngine",
    "TokenLogprob",
    "ToolCall",
    "ToolFunction",
    "build_executor",
    "builtin_model_path",
    "estimate_gguf_bytes",
    "heap_free_bytes",
    "limit_arenas",
    "panics_as_model_file_errors",
    "probe_gguf_chat_template",
    "release_freed_heap",
    "use_gguf_header_store",
    "weight_cache",
]


class RankInfo(msgspec.Struct, frozen=True):
    """One tensor-parallel rank, as `/v1/node` lists it under a model's `ranks`."""

    device: str  # "cuda:0", "cpu"
    heads: int  # attention heads this rank holds
    kv_heads: int


class ServingEngine(Protocol):
    """What the model actor needs of `engine.engine.Engine` (sync, not thread-safe, but for
    the prompt calls, which read only the tokenizer, template and grammar cache): a prompt
    prepared and checked once (`prepare`), then sequences (`add` trusts the prepared prompt)
    and steps."""

    tokenizer: Tokenizer  # /tokenize, /detokenize (service/requests/tokenize.py): thread-safe reads

    # The effective context: the configured one capped by the model's own (sizing.py); what
    # /v1/models and /v1/node show once the model is loaded.
    context: int

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[ToolFunction] = (),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...
    def encode_prompt(self, text: str, *, chat: bool) -> list[int]: ...
    def prepare(
        self,
        params: SamplingParams,
        *,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        ids: Sequence[int] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        default_max_tokens: int = 0,
    ) -> PreparedPrompt: ...
    def compile_constraint(self, constraint: Constraint) -> object: ...
    def constraint_compiled(self, constraint: Constraint) -> bool: ...
    def add(
        self,
        prompt: PreparedPrompt,
        *,
        cache_salt: bytes | None = None,
        tenant: str | None = None,
    ) -> int: ...
    def cancel(self, seq_id: int) -> None: ...
    def cancel_all(self) -> list[int]: ...
    def park(self, seq_id: int) -> bool: ...
    def resume(self, seq_id: int) -> None: ...
    def can_admit(self, prompt_tokens: int, n: int = 1) -> bool: ...
    @property
    def free_slots(self) -> int: ...
    @property
    def has_work(self) -> bool: ...
    def statistics(self) -> EngineStatistics: ...
    def record_kv_events(self, log: KVEventLog | None) -> None: ...
    def share_fairly(self, fair: FairShare | None) -> None: ...


class ModelExecutor(Protocol):
    """One loaded model: its engine, ranks and communicator (`executor.executor.Executor`).

    - `step()` / `probe()`: one engine step / one tiny forward on the scratch row; they block
      their thread (for ever if a collective wedges, until `abort_comm()` unblocks them).
    - `warm_up()`: a few tiny requests run to the end before serving (`engine.warm_up`), so
      that the first real request pays no one-time cost; blocks like a few steps.
    - `abort_comm()`: abort every rank's communicator; may itself block for ever.
    - `recreate_comm()`, `close()`: NCCL init and destroy; may block too.
    With tp = 1 there is no communicator: `abort_comm` and `recreate_comm` do nothing.
    """

    @property
    def engine(self) -> ServingEngine: ...
    @property
    def tp(self) -> int: ...
    @property
    def comm(self) -> Communicator | None: ...
    @property
    def ranks(self) -> list[RankInfo]: ...
    @property
    def dtype(self) -> str: ...  # what the weights really are, e.g. "cpu-int", "bfloat16"

    def step(self) -> list[SequenceEvent]: ...
    def probe(self) -> None: ...
    def warm_up(self) -> object: ...  # tiny requests before serving (engine.warm_up)
    def abort_comm(self) -> None: ...
    def recreate_comm(self) -> None: ...
    def close(self) -> None: ...


# The heavy parts (torch, the loader, the packed-weight cache), imported when called: the
# service imports this module at start-up and must not pay for torch there.


def weight_cache(directory: Path, max_bytes: int, *, min_file_bytes: int) -> WeightCache:
    """The packed-weight cache (`engine.model.load.weight_cache.WeightCache`) for `build_executor`."""
    from neuron_trio.engine.model.load.weight_cache import WeightCache

    return WeightCache(directory, max_bytes, min_file_bytes=min_file_bytes)


def build_executor(
    spec: ModelConfig,
    path: Path,
    devices: list[torch.device],
    *,
    failpoints: fp.Failpoints,
    weight_cache: WeightCache | None,
    draft_path: Path | None = None,
) -> ModelExecutor:
    """`executor.executor.build_executor`: load the model and build its engine (slow,
    blocking: call it on a worker thread). `draft_path`: the speculative draft's file."""
    from neuron_trio.executor import executor

    return executor.build_executor(
        spec,
        path,
        devices,
        failpoints=failpoints,
        weight_cache=weight_cache,
        draft_path=draft_path,
    )


def estimate_gguf_bytes(
    path: Path, dtype: str, device: str, *, kv_cache_mb: int, max_batch: int, context: int
) -> tuple[int, int]:
    """(weights, KV pool) bytes of the GGUF file at `path` on a `device` ("cuda", "cpu") as
    the loader would store them (`engine.model.load.sizing`). Reads the header and tensor table
    only. ConfigError if the KV budget holds no block; ModelLoadError for an unusable file."""
    from neuron_trio.engine.gguf.file import GGUFFile
    from neuron_trio.engine.model.load.sizing import estimate_kv_bytes, estimate_weight_bytes

    with GGUFFile(path) as gguf:
        weights = estimate_weight_bytes(gguf, dtype, device)
        kv = estimate_kv_bytes(
            gguf.config,
            dtype,
            device,
            kv_cache_mb=kv_cache_mb,
            max_batch=max_batch,
            context=context,
        )
    return weights, kv


def use_gguf_header_store(directory: Path | None) -> None:
    """Keep parsed GGUF headers between starts in `directory` (None: nowhere);
    `engine.gguf.header_memo.STORE`."""
    header_memo.STORE.use(directory)
