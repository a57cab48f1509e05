"""What the service layer may ask of a loaded model: `ModelExecutor` and its `ServingEngine`.

One description of `executor.executor.Executor`, used by the model actor and the watchdog,
and checked against the real class by mypy (`executor.py` assigns the class to this
protocol's type). Tests pass fakes that satisfy it too. No torch here: the service layer
imports this module at start-up.

The executor's methods block (NCCL calls, forwards): call them on worker threads only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import msgspec

from neuron_trio.engine.fair_share import FairShare
from neuron_trio.engine.kv_events import KVEventLog
from neuron_trio.engine.prompt import PromptEngine
from neuron_trio.engine.types import (
    Constraint,
    EngineStatistics,
    SamplingParams,
    SequenceEvent,
)

if TYPE_CHECKING:
    from neuron_trio.engine.text.tokenizer import Tokenizer
    from neuron_trio.executor.comm import Communicator


class RankInfo(msgspec.Struct, frozen=True):
    """One tensor-parallel rank, as `/v1/node` lists it under a model's `ranks`."""

    device: str  # "cuda:0", "cpu"
    heads: int  # attention heads this rank holds
    kv_heads: int


class ServingEngine(PromptEngine, Protocol):
    """What the model actor needs of `engine.engine.Engine` (sync, not thread-safe): prompt
    preparation (`engine.prompt.prepare_prompt`), then sequences and steps."""

    tokenizer: Tokenizer  # /tokenize, /detokenize (service/tokenize.py): thread-safe reads

    # The effective context: the configured one capped by the model's own (sizing.py); what
    # /v1/models and /v1/node show once the model is loaded.
    context: int

    def constraint_compiled(self, constraint: Constraint) -> bool: ...
    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        chat: bool,
        cache_salt: bytes | None = None,
        tenant: str | None = None,
    ) -> int: ...
    def cancel(self, seq_id: int) -> None: ...
    def cancel_all(self) -> list[int]: ...
    def can_admit(self, prompt_tokens: int, n: int = 1) -> bool: ...
    def answer_room(self, prompt_tokens: int) -> int: ...
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
