"""Continuous batching: which sequences run in the next step, and on which KV blocks.

Plain bookkeeping, no torch. Sequences join and leave only at step boundaries:

- `admit` takes a new sequence while fewer than `max_batch` run (`max_batch` limits
  concurrency; memory is the block pool's) or refuses (the caller queues);
- `schedule` plans one step: one decode row for every sequence that is decoding, plus
  prefill chunks of the sequences still prefilling, oldest first, run together as one batch
  padded to its longest chunk. The batch (rows × longest chunk, padding included) stays
  within `prefill_chunk` tokens, so a long prompt is spread over several steps and never
  stalls the decodes, while several short prompts that arrive together are prefilled at once.
  Every planned row gets the blocks its new tokens need; a sequence starting its prefill
  first takes the longest cached prefix of its tokens (prefix cache);
- when the pool runs out, a decode row (or the oldest prefill, when nothing else can run)
  preempts the youngest sequence holding blocks, itself included if it is the youngest
  (vLLM's recompute): its blocks go back to the pool (its full ones stay cached, so
  recomputing is cheap) and it is prefilled again when blocks are free, ahead of every
  younger sequence: prompt + output but the last token, without sampling, then decodes on.
  Prefill chunks never preempt running decodes; they wait. `Engine.prepare`
  (prompt.check_prompt) refuses a request that could not fit in the pool alone, so the
  oldest sequence always progresses;
- with tenants (`fair`, engine/fair_share.py), prefills go first for the tenant holding the
  fewest sequences (over its weight; oldest first within a tenant), and a busier tenant's
  chunk joins another's step no wider than it, so a flood of long prompts neither delays nor
  pads another tenant's first token; and while another tenant has a request on the node or
  ended one within `RECENT_S` (seconds), a tenant holding more sequences than another
  gets a thirty-second of the prefill budget (`_chunk_cap`: its rows × width within
  `prefill_chunk // 32`): a step stays short, so the other's
  next request, arriving mid-step, waits for a short step, not a long prompt's (a lone
  sequence's short prompt, up to an eighth of the budget, is not split); the step that gives a lighter
  tenant its first token leaves the heavier tenants' rows out (`_first_tokens_alone`); the
  pool's shortage is taken from the tenant with the largest virtual token counter: a row may
  preempt any younger sequence, or an older one of a tenant that has received more service
  than its own; among those, the heaviest tenant's youngest (itself, if that is it). One
  tenant (or none): exactly the rules above;
- `park` takes a decoding sequence out of the running set (its slot goes to a lighter
  tenant's waiting request: service/requests/request_table.py): it is preempted as above
  (its full blocks stay cached) and waits outside max_batch until `resume` takes it back as
  the youngest, to be prefilled again without sampling;
- `cache_blocks` (after a step) registers the blocks that became full in the prefix cache;
- `release` gives a finished or cancelled sequence's blocks back at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron_trio.engine.block_pool import BLOCK_TOKENS, BlockPool, block_key, blocks_for
from neuron_trio.engine.fair_share import FairShare
from neuron_trio.engine.sequence import Sequence, SequenceStatus
from neuron_trio.errors import NeuronError


class NoFreeSlotError(NeuronError):
    """Raised by `Scheduler.admit` (and `Engine.add`) if max_batch sequences run: queue, retry."""


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first position of the chunk
    end: int  # one past its last

    @property
    def is_last(self) -> bool:
        """The chunk completes the sequence's prefill."""
        return self.end == self.seq.prefill_len

    @property
    def samples(self) -> bool:
        """Its logits give the sequence's first token (not so for a preempted one: it has it)."""
        return self.is_last and self.seq.num_output == 0


@dataclass(frozen=True)
class StepPlan:
    decode: list[Sequence]  # one token each, batched in one forward
    prefill: list[PrefillChunk]  # oldest first, padded to the longest and batched in another
    preempted: list[Sequence] = field(default_factory=list)  # sent back to prefill this step

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, *, max_batch: int, prefill_chunk: int, pool: BlockPool):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.pool = pool
        # Invariant: `_active` holds at most max_batch sequences, none FINISHED, in admission
        # order (so "oldest first" and "the youngest" are its two ends); a DECODING sequence
        # holds the blocks of all its cached positions, and only sequences in `_active` hold
        # blocks of the pool.
        self._active: dict[int, Sequence] = {}  # seq_id -> sequence, in admission order
        self._looked_up: set[int] = set()  # sequences whose prefill start checked the cache
        # Parked sequences (`park`): preempted, holding no block and no slot, until `resume`.
        self._parked: dict[int, Sequence] = {}
        self.preemptions = 0
        # The tenants' counters (the model actor's, read during a step): None, one tenant.
        self.fair: FairShare | None = None
        self._held_back = False  # the last plan left a busier tenant's rows out

    @property
    def free_slots(self) -> int:
        """Sequences that may still be admitted (max_batch limits concurrency)."""
        return self.max_batch - len(self._active)

    @property
    def has_work(self) -> bool:
        return bool(self._active)

    @property
    def sequences(self) -> list[Sequence]:
        return list(self._active.values())

    def get(self, seq_id: int) -> Sequence | None:
        """The sequence `seq_id`, running or parked."""
        seq = self._active.get(seq_id)
        return seq if seq is not None else self._parked.get(seq_id)

    def count(self, status: SequenceStatus) -> int:
        return sum(1 for seq in self._active.values() if seq.status is status)

    def admit(self, seq: Sequence) -> None:
        """Take `seq` (it gets blocks when scheduled); NoFreeSlotError if max_batch run."""
        if len(self._active) >= self.max_batch:
            raise NoFreeSlotError(f"all {self.max_batch} sequences of max_batch are running")
        if seq.seq_id in self._active:
            raise ValueError(f"sequence {seq.seq_id} is already admitted")
        seq.status = SequenceStatus.PREFILLING
        seq.prefilled = 0
        self._active[seq.seq_id] = seq

    def park(self, seq: Sequence) -> None:
        """Free `seq`'s slot: it is preempted (blocks back, full ones cached) and waits,
        holding nothing, for `resume`. Only a DECODING sequence may be parked."""
        if self._active.get(seq.seq_id) is not seq or seq.status is not SequenceStatus.DECODING:
            raise ValueError(f"sequence {seq.seq_id} is not decoding here")
        del self._active[seq.seq_id]
        self._preempt(seq)
        self._parked[seq.seq_id] = seq

    def resume(self, seq_id: int) -> None:
        """Take parked `seq_id` back as the youngest (it prefills again, without sampling);
        NoFreeSlotError if max_batch run."""
        if seq_id not in self._parked:
            raise ValueError(f"sequence {seq_id} is not parked")
        if len(self._active) >= self.max_batch:
            raise NoFreeSlotError(f"all {self.max_batch} sequences of max_batch are running")
        self._active[seq_id] = self._parked.pop(seq_id)

    def release(self, seq: Sequence) -> None:
        """Mark `seq` finished and give its blocks back (no-op if it is not active)."""
        if (
            self._active.pop(seq.seq_id, None) is None
            and self._parked.pop(seq.seq_id, None) is None
        ):
            return
        seq.status = SequenceStatus.FINISHED
        self._drop_blocks(seq)

    def release_all(self) -> list[Sequence]:
        dropped = [*self._active.values(), *self._parked.values()]
        for seq in dropped:
            self.release(seq)
        return dropped

    def schedule(self) -> StepPlan:
        preempted: list[Sequence] = []
        decode: list[Sequence] = []
        for seq in list(self._active.values()):
            # the row writes position decode_pos: its blocks must cover decode_pos + 1 tokens
            if seq.status is SequenceStatus.DECODING and self._grow(
                seq, seq.decode_pos + 1, preempted, may_preempt=True
            ):
                decode.append(seq)
        if preempted:  # a heavier tenant's older row, planned before it was preempted
            gone = {victim.seq_id for victim in preempted}
            decode = [seq for seq in decode if seq.seq_id not in gone]
        prefill: list[PrefillChunk] = []
        width = 0  # the longest chunk so far: every row is padded to it
        for seq in self._prefill_order():
            if seq in preempted:
                continue
            # The widest chunk this row may have so that rows × width fits the budget. When
            # it is narrower than a row already planned, joining would cut that row short:
            # the rest waits for the next step, keeping the oldest first.
            if seq.seq_id not in self._looked_up:
                self._reuse_cached_prefix(seq)
            room = self._chunk_cap(seq) // (len(prefill) + 1)
            if room < max(width, 1):
                break
            end = min(seq.prefill_len, seq.prefilled + room)
            if prefill and self._heavier(seq, prefill[0].seq):
                # A lighter tenant's prefill leads this step: a heavier tenant's row joins it
                # without widening the batch (its long prompt does not pad the other's step).
                end = min(end, seq.prefilled + width)
            if decode or prefill:  # only the blocks free now: younger rows wait, in order
                end = min(end, (len(seq.blocks) + self.pool.available) * BLOCK_TOKENS)
                self._grow(seq, end, preempted, may_preempt=False)
            elif not self._grow(seq, end, preempted, may_preempt=True):
                break
            if end <= seq.prefilled:
                break
            prefill.append(PrefillChunk(seq, seq.prefilled, end))
            width = max(width, end - seq.prefilled)
        return self._first_tokens_alone(StepPlan(decode, prefill, preempted))

    def _first_tokens_alone(self, plan: StepPlan) -> StepPlan:
        """With tenants: a step that gives a lighter tenant its first token leaves out the rows
        of every tenant heavier than it (they wait one step, their blocks kept), so that first
        token costs a step of its own prompt, as on an idle node, not one carrying the flood's
        decode rows and prefill chunk beside it (tenancy drill, 2 cores: 0.01-0.02 s against
        0.035-0.05 s). Never two steps running: many light tenants arriving one after another
        cannot hold a busier one back for more than every other step."""
        held_back, self._held_back = self._held_back, False
        if self.fair is None or held_back:
            return plan
        firsts = [c.seq for c in plan.prefill if c.samples]
        if not firsts:
            return plan
        lightest = min(firsts, key=lambda s: self._load(s.tenant))
        decode = [s for s in plan.decode if not self._heavier(s, lightest)]
        prefill = [c for c in plan.prefill if not self._heavier(c.seq, lightest)]
        if len(decode) == len(plan.decode) and len(prefill) == len(plan.prefill):
            return plan
        self._held_back = True
        return StepPlan(decode, prefill, plan.preempted)

    def _load(self, tenant: str | None) -> float:
        """How much of each step `tenant` takes now: its sequences here over its weight.

        Prefills are ordered by this rather than by the counters: a tenant's counter jumps by
        its prompt at admission, so a newcomer lifted to the flood's counter would look the
        heavier one exactly while its first prefill waits."""
        fair = self.fair
        if fair is None:
            return 0.0
        held = sum(1 for s in self._active.values() if s.tenant == tenant)
        return held / fair.weight(tenant)

    def _chunk_cap(self, seq: Sequence) -> int:
        """The most of `seq`'s prompt one step may prefill: the whole budget, but a
        thirty-second of it (half a block at least) for a tenant holding more of a step than
        another tenant on the node or gone a moment ago (`FairShare.recent`: that one's next
        request may come any moment, and waits for the step then running). Why so little:
        in the tenancy drill (2 cores) a step of the flood's decode rows took 0.005-0.01 s,
        0.025 s with a 16-token chunk beside them (0.5 s with 256), and calm's own 23-token
        first step 0.02 s; its first token took twice its idle time with 16-token chunks
        (one such step to wait, then its own), 1.3-1.4 times with 8 (the flood's tokens/s
        5% lower). A tenant's lone short prompt (up to an eighth of the budget: a chat turn)
        is taken whole: one step of it costs less than two, each a pass over the weights."""
        fair = self.fair
        if fair is None:
            return self.prefill_chunk
        recent = fair.recent()
        if len(recent) < 2 or seq.tenant not in recent:
            return self.prefill_chunk
        mine = self._load(seq.tenant)
        if all(mine <= self._load(t) for t in recent if t != seq.tenant):
            return self.prefill_chunk
        cap = max(BLOCK_TOKENS // 2, self.prefill_chunk // 32)
        rest = seq.prefill_len - seq.prefilled
        short = max(2 * cap, self.prefill_chunk // 8)
        if rest <= short and all(s is seq for s in self._active.values() if s.tenant == seq.tenant):
            return rest
        return cap

    def _heavier(self, seq: Sequence, than: Sequence) -> bool:
        """`seq`'s tenant takes more of a step than `than`'s (another tenant's)."""
        return seq.tenant != than.tenant and self._load(seq.tenant) > self._load(than.tenant)

    def _prefill_order(self) -> list[Sequence]:
        """The prefilling sequences, oldest first; with tenants, those of the tenant taking
        least of a step first (a flood of long prompts does not hold back another tenant's
        first token)."""
        seqs = [s for s in self._active.values() if s.status is SequenceStatus.PREFILLING]
        if self.fair is None:
            return seqs
        load = {t: self._load(t) for t in {s.tenant for s in seqs}}
        return sorted(seqs, key=lambda s: load[s.tenant])  # stable: oldest first

    def cache_blocks(self, seq: Sequence, written: int) -> None:
        """Positions 0 .. written - 1 of `seq` are in its blocks: register the full ones not
        registered yet in the prefix cache (their keys name their tokens and all before)."""
        if not self.pool.prefix_cache:
            return
        keys = seq.block_keys
        for i in range(len(keys), written // BLOCK_TOKENS):
            parent = keys[-1] if keys else seq.cache_root
            tokens = seq.tokens(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
            key = block_key(parent, tokens)
            events = self.pool.events
            # A salted chain hangs from a parent that is never published (its salt's root), so
            # the log skips its blocks: a tenant's prefix never reaches a router (kv_events.py).
            if self.pool.register(seq.blocks[i], key) and events is not None:
                events.stored(key, parent, tokens)
            keys.append(key)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """`child` (another choice of `parent`'s request, FORKING) takes the prompt `parent`
        has just prefilled: it shares the full blocks and gets a copy of the partial last one.
        Returns (source, destination) of the block to copy, if any.

        With no block free for that copy, the child keeps the shared blocks and prefills the
        partial block's tokens itself (as after a preemption: without sampling).
        """
        full = parent.prefilled // BLOCK_TOKENS
        shared = parent.blocks[:full]
        self.pool.share(shared)
        child.blocks = list(shared)
        child.block_keys = list(parent.block_keys[:full])
        self._looked_up.add(child.seq_id)
        if parent.prefilled % BLOCK_TOKENS and not self.pool.available:
            child.prefilled = full * BLOCK_TOKENS
            child.status = SequenceStatus.PREFILLING
            return None
        child.prefilled = parent.prefilled
        child.status = SequenceStatus.DECODING
        if parent.prefilled % BLOCK_TOKENS == 0:
            return None
        copy = self.pool.allocate(child.tenant)
        child.blocks.append(copy)
        return parent.blocks[full], copy

    # ---- blocks ----------------------------------------------------------------------------

    def _reuse_cached_prefix(self, seq: Sequence) -> None:
        """A sequence starting (or restarting) its prefill takes the longest cached prefix of
        its tokens; at least the last one is computed (its logits, or its K/V row)."""
        self._looked_up.add(seq.seq_id)
        if seq.blocks or not self.pool.prefix_cache or seq.collects_prompt_logprobs:
            return  # (a cached block has no logits for a prompt's logprobs)
        n = seq.prefill_len
        seq.blocks, seq.block_keys = self.pool.lookup(seq.tokens(0, n), n - 1, seq.cache_root)
        seq.prefilled = len(seq.blocks) * BLOCK_TOKENS

    def _grow(
        self, seq: Sequence, tokens: int, preempted: list[Sequence], *, may_preempt: bool
    ) -> bool:
        """Give `seq` blocks for `tokens` positions; False if the pool cannot (then `seq`
        keeps what it got). With `may_preempt`, younger sequences (or `seq` itself, when it is
        the youngest holding blocks) are preempted until it can."""
        need = blocks_for(tokens)
        while len(seq.blocks) < need:
            if self.pool.available:
                seq.blocks.append(self.pool.allocate(seq.tenant))
                continue
            victim = self._victim(seq) if may_preempt else None
            if victim is None:
                return False
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _victim(self, seq: Sequence) -> Sequence | None:
        """Whom `seq` preempts: among the sequences holding blocks that are not older than
        `seq`, or whose tenant has a larger counter than `seq`'s, the youngest of the tenant
        with the largest counter. Without tenants: the youngest not older than `seq`."""
        fair = self.fair
        mine = fair.counter(seq.tenant) if fair is not None else 0.0
        best: Sequence | None = None
        best_key = (0.0, -1)
        younger = False  # past `seq` in admission order
        for i, other in enumerate(self._active.values()):
            younger = younger or other is seq
            if not other.blocks:
                continue
            counter = fair.counter(other.tenant) if fair is not None else 0.0
            if (younger or counter > mine) and (best is None or (counter, i) > best_key):
                best, best_key = other, (counter, i)
        return best

    def _preempt(self, seq: Sequence) -> None:
        self._drop_blocks(seq)
        seq.prefilled = 0
        seq.status = SequenceStatus.PREFILLING
        seq.preemptions += 1
        self.preemptions += 1

    def _drop_blocks(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.block_keys = []
        self._looked_up.discard(seq.seq_id)
