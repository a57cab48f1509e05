"""The engine: requests in, one batched step at a time, text events out.

`Engine` joins the scheduler (which sequences run, on which KV blocks), the runner (one
forward over a batch of rows), the sampler and each sequence's text pipeline. It is
synchronous, blocking code; the service layer drives it from a worker thread, one call at a
time (it is not thread-safe).

The KV cache is a pool of blocks (`block_pool`): sequences take blocks as they grow, share
the full blocks of a common prompt prefix (prefix cache) and are preempted and recomputed
when the pool runs out (see `scheduler`). The pool's probe block is scratch, used only by
`probe`, so a probe never disturbs a running sequence.

A step that raises (a failed or aborted forward) leaves no sequence half-advanced: state is
changed only after the forwards returned. The caller then usually calls `cancel_all`.

Structured output: a sequence with a `Constraint` holds a grammar state; each step fills the
masks of the rows it samples (on a thread beside the forward) and applies them to the logits
the runner returns, which under tensor parallelism are already gathered. A request of n
choices is n sequences: the first prefills the prompt, the others (FORKING until then) share
its full K/V blocks, copy its partial last one and sample their first token from the same
logits; every event carries the first one's id and the choice's `index`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from neuron_trio.engine.batch import probe, row_logits, run_plan, sampled_rows
from neuron_trio.engine.block_pool import (
    BlockPool,
    blocks_for,
    salt_root,
)
from neuron_trio.engine.fair_share import FairShare
from neuron_trio.engine.finish import token_event
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.kv_events import KVEventLog
from neuron_trio.engine.model.load.loader import SingleRunner, load_transformer
from neuron_trio.engine.model.load.sizing import engine_sizing
from neuron_trio.engine.model.runner import Runner
from neuron_trio.engine.model.step_threads import StepThreads
from neuron_trio.engine.prompt import (
    PreparedPrompt,
    PromptLimits,
    chat_template_for,
    check_prompt,
    encode_text,
    prepare_prompt,
    render_messages,
)
from neuron_trio.engine.prompt_logprobs import collect_prompt_logprobs, start_prompt_logprobs
from neuron_trio.engine.sampling import Sampler, SamplingState
from neuron_trio.engine.scheduler import NoFreeSlotError, Scheduler, StepPlan
from neuron_trio.engine.sequence import Sequence, SequenceStatus
from neuron_trio.engine.speculation.draft_model import DraftModel, load_draft
from neuron_trio.engine.speculation.speculative import Speculator, trim_blocks, verify
from neuron_trio.engine.text.chat import end_of_turn_ids
from neuron_trio.engine.text.reasoning import (
    ReasoningSplitter,
    prompt_opens_thinking,
    think_tag_ids,
    thinks_in_tags,
)
from neuron_trio.engine.text.structured.grammar import (
    GrammarCompiler,
    GrammarState,
    ToolCallFormat,
    apply_masks,
    detect_tool_format,
    fill_masks,
)
from neuron_trio.engine.text.textgen import TextPipeline
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.text.tools.tool_call_parser import ToolCallParser
from neuron_trio.engine.text.tools.tool_call_start import CallStartWatcher, begin_call_grammar
from neuron_trio.engine.text.tools.tool_calls import tool_marker_ids
from neuron_trio.engine.types import (
    Constraint,
    EngineStatistics,
    SamplingParams,
    SequenceEvent,
    ToolFunction,
)

__all__ = ["PREFILL_CHUNK", "Engine", "NoFreeSlotError"]

# Tokens a step's prefill batch holds at most (rows x longest chunk, padding included).
PREFILL_CHUNK = 256


class Engine:
    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        *,
        max_batch: int,
        context: int,
        prefill_chunk: int = PREFILL_CHUNK,
        chat_template: Any = None,
        prefix_cache: bool = True,
        tool_call_format: str = "auto",
        speculative_tokens: int = 0,
        draft: DraftModel | None = None,
    ):
        if context > runner.context:
            raise ValueError(f"context {context} exceeds the runner's {runner.context}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.context = context
        self.prefill_chunk = prefill_chunk
        self.vocab_size = runner.config.vocab_size
        self.pool = BlockPool(runner.blocks, prefix_cache=prefix_cache)
        self.scheduler = Scheduler(max_batch=max_batch, prefill_chunk=prefill_chunk, pool=self.pool)
        self.sampler = Sampler(token_text=tokenizer.token_text)
        if chat_template is None or isinstance(chat_template, str):
            chat_template = chat_template_for(tokenizer, chat_template)
        self.chat_template = chat_template
        self._eos_ids = frozenset() if tokenizer.eos_id is None else frozenset({tokenizer.eos_id})
        self._end_of_turn_ids = frozenset(end_of_turn_ids(tokenizer)) | self._eos_ids
        self._grammar: GrammarCompiler | None = None  # built on first use (0.1 s)
        self._tool_format: ToolCallFormat | None = None
        self._tool_style = tool_call_format  # "auto": read from the chat template
        self._groups: dict[int, list[Sequence]] = {}  # requests of n > 1 choices, by id
        self._masks: ThreadPoolExecutor | None = None  # fills grammar masks beside the forward
        # the kernels' threads: fewer while other work keeps cores busy (step_threads)
        self._threads = StepThreads() if runner.device.type == "cpu" else None
        self._ids = itertools.count(1)
        self._epoch = 0  # bumped by cancel_all: a step that was in flight then is void
        self._steps = 0
        # Speculation (speculative.py): drafts of up to this many tokens (0: off), from the
        # prompt lookup or, when given, a draft model (draft_model.py)
        self.speculator = (
            Speculator(speculative_tokens, draft=draft) if speculative_tokens else None
        )
        self._prompt_tokens_total = 0
        self._generated_tokens_total = 0

    @classmethod
    def from_gguf(
        cls,
        path: str | Path,
        *,
        dtype: str = "auto",
        device: torch.device | str = "cpu",
        max_batch: int = 8,
        context: int = 4096,
        prefill_chunk: int = PREFILL_CHUNK,
        kv_cache_mb: int = 0,
        prefix_cache: bool = True,
        speculative_tokens: int = 0,
        draft_path: str | Path | None = None,
    ) -> Engine:
        """Load a GGUF model on one device (tp = 1) with its tokenizer and chat template.

        For tools, tests and benchmarks; the daemon builds every model (tp = 1 or more)
        through `build_executor`, which sizes it the same way (`sizing.engine_sizing`). `context` (tokens per sequence) is capped at the context the model was
        trained for. The KV pool holds `kv_cache_mb` MiB, or with 0, `max_batch` × `context`
        tokens (`sizing.engine_sizing`). The file is parsed once (weights and tokenizer)
        and closed before this returns. `draft_path`: a draft model's file for speculation
        (draft_model.py; with `speculative_tokens`).
        """
        with GGUFFile(path) as gguf:
            sizing = engine_sizing(
                gguf.config,
                dtype,
                device,
                kv_cache_mb=kv_cache_mb,
                max_batch=max_batch,
                context=context,
            )
            model = load_transformer(gguf, dtype=dtype, device=torch.device(device))
            tokenizer = Tokenizer.from_gguf(gguf)
        context = sizing.context
        runner = SingleRunner(model, blocks=sizing.kv_blocks, context=context)
        draft = None
        if draft_path is not None:
            draft = load_draft(
                draft_path, tokenizer.tokens, dtype=dtype, device=device, context=context
            )
        return cls(
            runner,
            tokenizer,
            max_batch=max_batch,
            context=context,
            prefill_chunk=prefill_chunk,
            prefix_cache=prefix_cache,
            speculative_tokens=speculative_tokens,
            draft=draft,
        )

    # ---- prompts -------------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: Seq[ToolFunction] = (),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template applied to `messages` (and `tools`, and the request's
        `template_kwargs`), ending with the assistant's turn opening
        (`prompt.render_messages`)."""
        return render_messages(self.chat_template, messages, tools, template_kwargs)

    @property
    def tool_format(self) -> ToolCallFormat:
        if self._tool_format is None:
            source = self.chat_template.source
            self._tool_format = detect_tool_format(self.tokenizer, source, self._tool_style)
        return self._tool_format

    def encode_prompt(self, text: str, *, chat: bool) -> list[int]:
        """Token ids of `text`, BOS added when the model wants it (`prompt.encode_text`)."""
        del chat  # a rendered chat template carries its own specials, BOS included or not
        return encode_text(self.tokenizer, text)

    @property
    def limits(self) -> PromptLimits:
        """What a request is checked against here (`prompt.check_request`)."""
        return PromptLimits(self.vocab_size, self.max_batch, self.context, self.pool.total)

    def prepare(
        self,
        params: SamplingParams,
        *,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        ids: Seq[int] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        default_max_tokens: int = 0,
    ) -> PreparedPrompt:
        """A request's prompt ready for `add`, in one pass: templated, tokenised and checked
        (`prompt.prepare_prompt`; RequestError, ContextLengthError if it cannot run). It reads
        only the tokenizer and template: thread-safe beside a step. The constraint is not
        compiled here (`compile_constraint`, or `add`)."""
        return prepare_prompt(
            self.chat_template,
            self.tokenizer,
            self.limits,
            params,
            text=text,
            messages=messages,
            ids=ids,
            template_kwargs=template_kwargs,
            default_max_tokens=default_max_tokens,
        )

    @property
    def grammar(self) -> GrammarCompiler:
        if self._grammar is None:
            self._grammar = GrammarCompiler(
                self.tokenizer,
                stop_ids=self._end_of_turn_ids,
                vocab_size=self.vocab_size,
                tool_format=self.tool_format,
            )
        return self._grammar

    def compile_constraint(self, constraint: Constraint) -> GrammarState:
        """Compile (or fetch from the cache) a constraint's grammar; RequestError if it is
        invalid or uses a feature that cannot be enforced. Thread-safe, and may be slow for a
        large schema: the service layer calls it off the event loop before `add`."""
        return self.grammar.compile(constraint)

    def constraint_compiled(self, constraint: Constraint) -> bool:
        """`compile_constraint(constraint)` would be a cache hit (fast, thread-safe)."""
        return self._grammar is not None and self._grammar.is_cached(constraint)

    # ---- sequences -----------------------------------------------------------------------

    def add(
        self,
        prompt: PreparedPrompt | Seq[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        cache_salt: bytes | None = None,
        tenant: str | None = None,
    ) -> int:
        """Start a request's sequence (its `params.n` choices: n of max_batch); its id, which
        every event of the request carries. NoFreeSlotError when max_batch sequences run
        (queue, retry); `can_admit` says whether to add now. With `cache_salt`, its prompt
        shares cached prefix blocks only with requests of the same salt. `tenant` is whose
        request it is, for the scheduler's fair share (`share_fairly`).

        A PreparedPrompt (`prepare`) was checked and is trusted; token ids with `params` and
        `chat` (tools, tests, warm-up) are checked here first (`prompt.check_prompt`).
        """
        if not isinstance(prompt, PreparedPrompt):
            assert params is not None, "token ids need their SamplingParams"
            prompt = check_prompt(prompt, params, chat=chat, limits=self.limits)
        prompt_ids, params, chat = prompt.ids, prompt.params, prompt.chat
        root = salt_root(cache_salt)
        if self.scheduler.free_slots < params.n:
            raise NoFreeSlotError(f"{params.n} slots needed, {self.scheduler.free_slots} free")
        group: list[Sequence] = []
        for index in range(params.n):
            # each choice draws its own tokens: choice i of seed s is seeded s + i
            choice_params = params
            if index and params.seed is not None:
                choice_params = replace(params, seed=params.seed + index)
            seq = self._new_sequence(list(prompt_ids), choice_params, chat)
            seq.cache_root = root
            seq.tenant = tenant
            seq.group_id = group[0].seq_id if group else seq.seq_id
            seq.index = index
            self.scheduler.admit(seq)
            if group:
                seq.status = SequenceStatus.FORKING
                group[0].forks.append(seq)
            group.append(seq)
        if len(group) > 1:
            self._groups[group[0].seq_id] = group
        return group[0].seq_id

    def _new_sequence(self, prompt: list[int], params: SamplingParams, chat: bool) -> Sequence:
        seq = Sequence(next(self._ids), prompt, params, chat=chat)
        seq.sampling = SamplingState(params, prompt)
        if params.prompt_logprobs:
            start_prompt_logprobs(seq, self.tokenizer.token_text)
        seq.reasoning = self._reasoning_for(prompt, params, chat)
        markers = tool_marker_ids(self.tokenizer) if params.tools else ()
        if seq.reasoning is not None:  # the splitter must see the tags, special or not
            markers = (*markers, *think_tag_ids(self.tokenizer))
        seq.text = TextPipeline.for_tokenizer(self.tokenizer, params.stop, prompt, markers)
        if params.constraint is not None:
            seq.sampling.grammar = self.compile_constraint(params.constraint)  # a cache hit
        if params.tools:
            seq.tool_calls = ToolCallParser(
                self.tool_format, params.tools, parallel=params.parallel_tool_calls
            )
            if params.constraint is None:  # auto: constrain a call once it begins
                seq.tool_calls.watcher = CallStartWatcher(self.tool_format, self.tokenizer)
        return seq

    def _reasoning_for(
        self, prompt: list[int], params: SamplingParams, chat: bool
    ) -> ReasoningSplitter | None:
        """The thinking splitter of a chat whose template thinks in tags; None for a
        constrained answer (its grammar says what it is from the first token: no thinking)."""
        if not chat or params.constraint is not None:
            return None
        if not thinks_in_tags(self.chat_template.source):
            return None
        # enough tokens to spell `<think>\n` even one byte a token
        tail = self.tokenizer.decode(prompt[-12:], skip_special_tokens=False)
        return ReasoningSplitter(inside=prompt_opens_thinking(tail))

    def cancel(self, seq_id: int) -> None:
        """Drop a request's sequences now; their blocks are free for the next `add`. Unknown
        ids are ignored."""
        group = self._groups.pop(seq_id, None)
        if group is None:
            single = self.scheduler.get(seq_id)
            group = [single] if single is not None else []
        for seq in group:
            if not seq.is_finished:
                seq.finish_reason = "cancelled"
                self.scheduler.release(seq)

    def cancel_all(self) -> list[int]:
        """Drop every sequence (after a wedge); the ids dropped."""
        self._epoch += 1
        self._groups.clear()
        dropped = self.scheduler.release_all()
        # A step abandoned in flight may still write its rows' blocks: cached prefixes could
        # be among them once reused, so the cache starts over.
        self.pool.clear_cache()
        for seq in dropped:
            seq.finish_reason = "cancelled"
        return sorted({seq.group_id or seq.seq_id for seq in dropped})

    def park(self, seq_id: int) -> bool:
        """Give request `seq_id`'s slot back for now (a lighter tenant waits): its sequence is
        preempted, its full blocks stay cached, and it produces nothing until `resume`; its
        output then goes on exactly as if it had not stopped. False (nothing done) unless it
        is one decoding sequence (not n choices, nor collecting prompt logprobs)."""
        seq = self.scheduler.get(seq_id)
        if seq is None or seq_id in self._groups or seq.status is not SequenceStatus.DECODING:
            return False
        if seq.collects_prompt_logprobs:
            return False
        self.scheduler.park(seq)
        return True

    def resume(self, seq_id: int) -> None:
        """Run parked `seq_id` again (NoFreeSlotError without a free slot; `can_admit` with
        its prompt and output says whether the pool holds it now)."""
        self.scheduler.resume(seq_id)

    @property
    def free_slots(self) -> int:
        return self.scheduler.free_slots

    def can_admit(self, prompt_tokens: int, n: int = 1) -> bool:
        """Whether a request of `n` choices of a `prompt_tokens` prompt should be added now:
        `n` of max_batch are free and the pool has the blocks of its prompt (cached prefixes
        not counted). Admitting only then keeps preemption for growth, not for arrivals."""
        return self.free_slots >= n and self.pool.available >= blocks_for(prompt_tokens) + n - 1

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def share_fairly(self, fair: FairShare | None) -> None:
        """Order prefills and choose preemptions by the tenants' counters in `fair` (kept by
        the model actor, read during steps); None: oldest first, the youngest preempted.
        The prefix cache is shared by their weights too (block_pool.py)."""
        self.scheduler.fair = fair
        self.pool.share_between(fair.weights if fair is not None else {})

    def record_kv_events(self, log: KVEventLog | None) -> None:
        """Record the prefix cache's changes into `log` from now on (None: no longer).
        Safe from any thread: steps pick it up at their next block (kv_events.py)."""
        self.pool.events = log

    def statistics(self) -> EngineStatistics:
        pool = self.pool.statistics()
        return EngineStatistics(
            slots_total=self.max_batch,
            slots_in_use=self.max_batch - self.scheduler.free_slots,
            prefilling=self.scheduler.count(SequenceStatus.PREFILLING),
            decoding=self.scheduler.count(SequenceStatus.DECODING),
            steps=self._steps,
            prompt_tokens_total=self._prompt_tokens_total,
            generated_tokens_total=self._generated_tokens_total,
            kv_blocks_total=pool.total,
            kv_blocks_used=pool.used,
            kv_blocks_cached=pool.cached,
            prefix_cache_queries_tokens=pool.query_tokens,
            prefix_cache_hits_tokens=pool.hit_tokens,
            preemptions=self.scheduler.preemptions,
            speculative_proposed_tokens=self.speculator.counts.proposed if self.speculator else 0,
            speculative_accepted_tokens=self.speculator.counts.accepted if self.speculator else 0,
        )

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> list[SequenceEvent]:
        """One step: a token for every decoding sequence, and a batch of prefill chunks.

        A sequence whose prompt is complete gets its first token in the same step. Finished
        sequences give their blocks back before this returns. As nano-vllm's: schedule,
        prepare the inputs (`batch`), run the forwards and sample, then post-process.
        """
        epoch = self._epoch
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        plan, drafted, drafts = self._split_drafts(plan)
        rows = sampled_rows(plan)
        # Structured output: the masks of the rows sampled this step depend only on the tokens
        # so far, so they are computed on a thread of their own while the forward runs
        # (llguidance releases the GIL; so do torch's kernels).
        grammars = [s.sampling.grammar for s in rows]
        masks = None
        if any(g is not None for g in grammars):
            masks = self._mask_thread().submit(fill_masks, grammars, self.vocab_size)
        with torch.inference_mode():
            prompt_rows: dict[int, torch.Tensor] = {}  # prefill chunk -> all its logits
            with self._threads.forward() if self._threads else nullcontext():
                logits = run_plan(self.runner, plan, prompt_rows)
                checked = verify(self.runner, drafted, drafts) if drafted else []
            bitmask = masks.result() if masks is not None else None
            results = self._sample(rows, logits, bitmask) if rows else []
        # The forwards returned: only now is any sequence's state advanced.
        self._steps += 1
        if epoch != self._epoch:
            # cancel_all ran while this step was in flight (a wedged step that came back late):
            # its sequences are gone and their blocks may already hold new ones.
            return []
        if prompt_rows:
            self._collect_prompt_logprobs(plan, prompt_rows)
        self._advance(plan)
        events = [
            self._accept(seq, result)
            for seq, result in zip(rows, results, strict=True)
            if not seq.is_finished  # cancelled while the step ran
        ]
        for seq, seq_logits in zip(drafted, checked, strict=True):
            if not seq.is_finished:
                events += self._accept_draft(seq, drafts[seq.seq_id], seq_logits)
        return events

    def _split_drafts(
        self, plan: StepPlan
    ) -> tuple[StepPlan, list[Sequence], dict[int, list[int]]]:
        """The decode rows that verify a draft this step (speculative.py), out of `plan`'s
        plain decode forward; their drafts by seq_id."""
        if self.speculator is None or not plan.decode:
            return plan, [], {}
        drafts = self.speculator.drafts(plan.decode, self.pool, self.runner.context)
        if not drafts:
            return plan, [], {}
        drafted = [s for s in plan.decode if s.seq_id in drafts]
        plain = [s for s in plan.decode if s.seq_id not in drafts]
        return replace(plan, decode=plain), drafted, drafts

    def _accept_draft(
        self, seq: Sequence, draft: list[int], logits: torch.Tensor
    ) -> list[SequenceEvent]:
        """The tokens `seq` gets from a verified draft: position j's logits sampled as a decode
        step would (the sequence's own sampler, penalties and logprobs included), on while the
        token picked is the draft's; each through the finish rules, so a stop, a stop string
        or max_tokens ends the run at its token. An auto tool call that begins ends it too
        (the next tokens need the call's grammar)."""
        pos = seq.decode_pos  # where the step wrote seq.last_token; the draft follows it
        events: list[SequenceEvent] = []
        matched = 0  # draft tokens the model agreed with
        with torch.inference_mode():
            for j in range(len(draft) + 1):
                self.scheduler.cache_blocks(seq, pos + j + 1)  # what is known to be right
                result = self.sampler.sample(logits[j : j + 1], [seq.sampling])[0]
                events.append(self._accept(seq, result))
                if j == len(draft) or result.token_id != draft[j]:
                    break
                matched += 1
                if seq.is_finished or seq.sampling.grammar is not None:
                    break
        assert self.speculator is not None
        self.speculator.record(seq, len(draft), matched)
        if not seq.is_finished:
            trim_blocks(seq, self.pool)
        return events

    def _sample(self, rows: list[Sequence], logits: list[torch.Tensor], bitmask: Any) -> list[Any]:
        """A token for each of `rows` (forks from their parent's logits, `batch.row_logits`);
        constrained rows through their masks."""
        batch = row_logits(rows, logits)
        states = [s.sampling for s in rows]
        if bitmask is None:
            return list(self.sampler.sample(batch, states))
        return list(self.sampler.sample(apply_masks(batch, bitmask), states, batch))

    def _advance(self, plan: StepPlan) -> None:
        """After the forwards: cache the blocks they filled, count prefilled tokens, and start
        decoding (and fork) the sequences whose prompt is complete."""
        for seq in plan.decode:
            self.scheduler.cache_blocks(seq, seq.decode_pos + 1)
        for chunk in plan.prefill:
            seq = chunk.seq
            seq.prefilled = chunk.end
            self.scheduler.cache_blocks(seq, chunk.end)
            self._prompt_tokens_total += chunk.end - chunk.start
            if chunk.is_last:
                seq.status = SequenceStatus.DECODING
                self._fork(seq)

    def _collect_prompt_logprobs(self, plan: StepPlan, rows: dict[int, torch.Tensor]) -> None:
        """The prompt logprobs that this step's chunks computed, into their sequences."""
        with torch.inference_mode():
            for i, chunk_rows in rows.items():
                chunk = plan.prefill[i]
                collect_prompt_logprobs(
                    chunk.seq, chunk.start, chunk_rows, self.tokenizer.token_text
                )

    def _mask_thread(self) -> ThreadPoolExecutor:
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._masks

    def _fork(self, seq: Sequence) -> None:
        """The prompt of `seq` is in its blocks: its other choices share them (the partial
        last block copied), and its prompt's logprobs when asked for."""
        for fork in seq.forks:
            fork.prompt_logprobs = seq.prompt_logprobs
        copies = [
            pair
            for fork in seq.forks
            if not fork.is_finished and (pair := self.scheduler.fork(seq, fork)) is not None
        ]
        if copies:
            self.runner.copy_blocks([src for src, _ in copies], [dst for _, dst in copies])
        seq.forks = []

    def _accept(self, seq: Sequence, result: Any) -> SequenceEvent:
        """The event of `seq`'s sampled token (`finish.token_event`); a finished sequence's
        blocks go back, and its request's group learns whether choices remain."""
        self._generated_tokens_total += 1
        event = token_event(
            seq,
            result,
            end_of_turn_ids=self._end_of_turn_ids,
            eos_ids=self._eos_ids,
            begin_call=self._begin_call,
        )
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            event.prompt_logprobs = seq.prompt_logprobs  # with the choice's first token
            seq.prompt_logprobs_sent = True
        if event.finish_reason is not None:
            seq.finish_reason = event.finish_reason
            self.scheduler.release(seq)
            group = self._groups.get(seq.group_id)
            if group is not None:
                event.more_choices = any(not s.is_finished for s in group)
                if not event.more_choices:
                    del self._groups[seq.group_id]
        return event

    def _begin_call(self, seq: Sequence, start: Any) -> Any:
        """The grammar for the rest of an `auto` tool call whose marker `seq` just emitted
        (compiled grammars are shared only within its prefix-cache salt: `Constraint.scope`)."""
        params = seq.params
        compiler = self.grammar.scoped(seq.cache_root, seq.tenant)
        return begin_call_grammar(
            compiler, self.tool_format, params.tools, params.parallel_tool_calls, start
        )

    def probe(self) -> None:
        """One tiny forward (one token) on the probe's own KV block; touches no sequence."""
        bos = self.tokenizer.bos_id
        probe(self.runner, 0 if bos is None else int(bos))
