"""Continuous batching: which sequences run in the next step, and in which slot.

Plain bookkeeping, no torch. Sequences join and leave only at step boundaries:

- `admit` gives a new sequence a free slot (KV row) or refuses (the caller queues);
- `schedule` plans one step: one decode row for every sequence that is decoding, plus
  prefill chunks of the sequences still prefilling, oldest first, run together as one batch
  padded to its longest chunk. The batch (rows × longest chunk, padding included) stays
  within `prefill_chunk` tokens, so a long prompt is spread over several steps and never
  stalls the decodes, while several short prompts that arrive together are prefilled at once;
- `release` gives a finished or cancelled sequence's slot back at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_trio.engine.sequence import Sequence, SequenceStatus
from neuron_trio.errors import NeuronError


class NoFreeSlotError(NeuronError):
    """Raised by `Scheduler.admit` (and `Engine.add`) if every slot is taken: queue and retry."""


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position of the chunk
    end: int  # one past its last

    @property
    def is_last(self) -> bool:
        """The chunk completes the prompt: its logits give the first token."""
        return self.end == self.seq.num_prompt


@dataclass(frozen=True)
class StepPlan:
    decode: list[Sequence]  # one token each, batched in one forward
    prefill: list[PrefillChunk]  # oldest first, padded to the longest and batched in another

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, *, max_batch: int, prefill_chunk: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._free: list[int] = list(range(max_batch))  # lowest slot first
        self._active: dict[int, Sequence] = {}  # seq_id -> sequence, in admission order

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def has_work(self) -> bool:
        return bool(self._active)

    @property
    def sequences(self) -> list[Sequence]:
        return list(self._active.values())

    def get(self, seq_id: int) -> Sequence | None:
        return self._active.get(seq_id)

    def count(self, status: SequenceStatus) -> int:
        return sum(1 for seq in self._active.values() if seq.status is status)

    def admit(self, seq: Sequence) -> None:
        """Give `seq` the lowest free slot; NoFreeSlotError if there is none."""
        if not self._free:
            raise NoFreeSlotError(f"all {self.max_batch} slots are in use")
        if seq.seq_id in self._active:
            raise ValueError(f"sequence {seq.seq_id} is already admitted")
        seq.slot = self._free.pop(0)
        seq.status = SequenceStatus.PREFILLING
        seq.prefilled = 0
        self._active[seq.seq_id] = seq

    def release(self, seq: Sequence) -> None:
        """Mark `seq` finished and give its slot back (no-op if it is not active)."""
        if self._active.pop(seq.seq_id, None) is None:
            return
        seq.status = SequenceStatus.FINISHED
        self._free.append(seq.slot)
        self._free.sort()

    def release_all(self) -> list[Sequence]:
        dropped = list(self._active.values())
        for seq in dropped:
            self.release(seq)
        return dropped

    def schedule(self) -> StepPlan:
        decode = [s for s in self._active.values() if s.status is SequenceStatus.DECODING]
        prefill: list[PrefillChunk] = []
        width = 0  # the longest chunk so far: every row is padded to it
        for seq in self._active.values():
            if seq.status is not SequenceStatus.PREFILLING:
                continue
            # The widest chunk this row may have so that rows × width fits the budget. When
            # it is narrower than a row already planned, joining would cut that row short:
            # the rest waits for the next step, keeping the oldest first.
            room = self.prefill_chunk // (len(prefill) + 1)
            if room < max(width, 1):
                break
            end = min(seq.num_prompt, seq.prefilled + room)
            prefill.append(PrefillChunk(seq, seq.prefilled, end))
            width = max(width, end - seq.prefilled)
        return StepPlan(decode, prefill)
