"""Test doubles shared by the service tests: threads, deadman, executors (no real threads).

- `FakeThreads`: the watchdog's ThreadRunner, trio-native: each "thread" is a task, a cancelled
  caller abandons it (it reports through `on_return` when it finishes, as a real abandoned
  thread does); `hold()` makes new calls wait for `release()`, as a wedged step would. A
  callable that returns an awaitable (ScriptedExecutor's methods) is awaited.
- `FakeDeadman`: records each firing (and the virtual instant), then raises DeadmanExit.
- `FakeExecutor` over `FakeEngine`: one token "x" per running sequence per step (model actor,
  node). `ScriptedExecutor`: steps, probes, aborts that hang, sleep or fail (watchdog).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import trio

from neuron_trio.engine.block_pool import BLOCK_TOKENS
from neuron_trio.engine.prompt import PreparedPrompt, PromptLimits, check_prompt
from neuron_trio.engine.types import EngineStatistics, SamplingParams, SequenceEvent
from neuron_trio.errors import CommAbortedError, CommError
from neuron_trio.executor.api import RankInfo
from neuron_trio.service.wedge.deadman import DeadmanExit


class FakeThreads:
    """A trio-native stand-in for the watchdog's thread runner, with abandon semantics."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.released = trio.Event()
        self.released.set()
        self.threads: list[str] = []  # thread names, in call order

    def hold(self) -> None:
        self.released = trio.Event()

    def release(self) -> None:
        self.released.set()

    async def __call__(
        self,
        fn: Callable[[], Any],
        *,
        thread_name: str,
        limiter: trio.CapacityLimiter,
        on_return: Callable[[BaseException | None], None],
    ) -> Any:
        self.threads.append(thread_name)
        done = trio.Event()
        box: dict[str, Any] = {}
        gate = self.released

        async def thread() -> None:
            await gate.wait()
            error: BaseException | None = None
            try:
                value = fn()
                if inspect.isawaitable(value):
                    value = await value
                box["value"] = value
            except Exception as exc:
                error = box["error"] = exc
            on_return(error)
            done.set()

        self.nursery.start_soon(thread)
        await done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")


class FakeDeadman:
    """Records the firing (at which virtual instant), then raises DeadmanExit."""

    def __init__(self) -> None:
        self.fired: list[dict[str, Any]] = []

    @property
    def firing(self) -> bool:
        return bool(self.fired)

    @property
    def reason(self) -> str | None:
        return self.fired[0]["reason"] if self.fired else None

    async def fire(self, reason: str, **kw: Any) -> NoReturn:
        self.fired.append({"reason": reason, "at": trio.current_time(), **kw})
        raise DeadmanExit(70, {"reason": reason}, None)


class FakeEngine:
    """One token ("x") per running sequence per step; finishes at max_tokens ("length")."""

    def __init__(self, max_batch: int, context: int = 64, kv_tokens: int | None = None) -> None:
        self.max_batch = max_batch
        self.context = context
        # the KV pool: every running sequence holds its prompt and what it produced
        self.kv_tokens = max_batch * context if kv_tokens is None else kv_tokens
        self.seqs: dict[int, list[Any]] = {}  # seq_id -> [params, produced, prompt_len]
        self.next_id = 1
        self.added: list[list[int]] = []
        self.salts: list[bytes | None] = []  # cache_salt of each add
        self.tenants: list[str | None] = []  # tenant of each add
        self.fair: Any = None  # what the actor handed to share_fairly
        self.cancelled: list[int] = []
        self.parked: dict[int, list[Any]] = {}  # taken out by park, until resume
        self.parks: list[int] = []  # seq_ids parked, in order
        self.steps = 0
        self.batches: list[int] = []  # sequences in each step
        self.rendered_on: list[bool] = []  # True: on the trio (main) thread
        self.kv_log: Any = None  # what a KV events publisher attached (record_kv_events)
        self.prepared = 0  # prompts prepared (and so checked): one per request

    def render_chat(self, messages: list[dict[str, Any]], tools: Any = ()) -> str:
        self.rendered_on.append(threading.current_thread() is threading.main_thread())
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def compile_constraint(self, constraint: Any) -> object:
        return constraint

    def constraint_compiled(self, constraint: Any) -> bool:
        return False

    def encode_prompt(self, text: str, *, chat: bool) -> list[int]:
        return [ord(c) for c in text]

    def record_kv_events(self, log: Any) -> None:
        self.kv_log = log

    def share_fairly(self, fair: Any) -> None:
        self.fair = fair

    def prepare(
        self,
        params: SamplingParams,
        *,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        ids: Any = None,
        template_kwargs: Any = None,
        default_max_tokens: int = 0,
    ) -> PreparedPrompt:
        """As Engine.prepare: rendered, encoded and checked (`prompt.check_prompt`, the one
        maker of a PreparedPrompt) against this fake's limits; each call counted."""
        self.prepared += 1
        if ids is not None:
            prompt, chat = list(ids), False
        elif messages is not None:
            prompt, chat = self.encode_prompt(self.render_chat(messages), chat=True), True
        else:
            prompt, chat = self.encode_prompt(text or "", chat=False), False
        limits = PromptLimits(
            vocab_size=0x110000,  # the fake's tokens are characters
            max_batch=self.max_batch,
            context=self.context,
            pool_blocks=self.kv_tokens // BLOCK_TOKENS,
        )
        return check_prompt(
            prompt, params, chat=chat, limits=limits, default_max_tokens=default_max_tokens
        )

    def add(
        self,
        prompt: PreparedPrompt,
        *,
        cache_salt: bytes | None = None,
        tenant: str | None = None,
    ) -> int:
        assert self.free_slots > 0
        assert isinstance(prompt, PreparedPrompt)
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.seqs[seq_id] = [prompt.params, 0, len(prompt.ids)]
        self.added.append(list(prompt.ids))
        self.salts.append(cache_salt)
        self.tenants.append(tenant)
        return seq_id

    def cancel(self, seq_id: int) -> None:
        self.cancelled.append(seq_id)
        self.seqs.pop(seq_id, None)
        self.parked.pop(seq_id, None)

    def park(self, seq_id: int) -> bool:
        state = self.seqs.get(seq_id)
        if state is None or state[1] == 0:  # as the engine: only a decoding sequence
            return False
        self.parked[seq_id] = self.seqs.pop(seq_id)
        self.parks.append(seq_id)
        return True

    def resume(self, seq_id: int) -> None:
        assert self.free_slots > 0
        self.seqs[seq_id] = self.parked.pop(seq_id)

    def cancel_all(self) -> list[int]:
        ids = [*self.seqs, *self.parked]
        self.seqs.clear()
        self.parked.clear()
        return ids

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.seqs)

    def can_admit(self, prompt_tokens: int, n: int = 1) -> bool:
        used = sum(prompt_len + produced for _, produced, prompt_len in self.seqs.values())
        return self.free_slots >= n and used + prompt_tokens <= self.kv_tokens

    @property
    def has_work(self) -> bool:
        return bool(self.seqs)

    def statistics(self) -> EngineStatistics:
        n = len(self.seqs)
        used = sum(prompt_len + produced for _, produced, prompt_len in self.seqs.values())
        return EngineStatistics(
            self.max_batch,
            n,
            0,
            n,
            self.steps,
            0,
            0,
            kv_blocks_total=self.kv_tokens // 16,
            kv_blocks_used=-(-used // 16),
            prefix_cache_queries_tokens=self.steps * 10,  # any counters, to see them pass
            prefix_cache_hits_tokens=self.steps * 5,
        )

    def step(self) -> list[SequenceEvent]:
        self.steps += 1
        self.batches.append(len(self.seqs))
        events = []
        for seq_id, state in list(self.seqs.items()):
            params, produced, prompt_len = state
            state[1] = produced = produced + 1
            event = SequenceEvent(
                seq_id,
                text="x",
                token_ids=[120],
                prompt_tokens=prompt_len,
                completion_tokens=produced,
            )
            if produced >= params.max_tokens:
                event.finish_reason = "length"
                del self.seqs[seq_id]
            events.append(event)
        return events


class FakeExecutor:
    def __init__(self, max_batch: int = 2, context: int = 64) -> None:
        self.engine = FakeEngine(max_batch, context)
        self.tp = 1
        self.comm = None
        self.dtype = "float32"
        self.ranks = [RankInfo(device="cpu", heads=9, kv_heads=3)]
        self.closed = False
        self.probes = 0
        self.warm_ups = 0
        self.fail_next_warm_up: Exception | None = None
        self.fail_next_step: Exception | None = None
        self.fail_next_probe: Exception | None = None

    def step(self) -> list[SequenceEvent]:
        if self.fail_next_step is not None:
            exc, self.fail_next_step = self.fail_next_step, None
            raise exc
        return self.engine.step()

    def probe(self) -> None:
        self.probes += 1
        if self.fail_next_probe is not None:
            exc, self.fail_next_probe = self.fail_next_probe, None
            raise exc

    def warm_up(self) -> str:
        self.warm_ups += 1
        if self.fail_next_warm_up is not None:
            exc, self.fail_next_warm_up = self.fail_next_warm_up, None
            raise exc
        return "fake warm-up"

    def abort_comm(self) -> None:
        pass

    def recreate_comm(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


# Behaviours: "ok", "hang", ("sleep", s), "error", and for step: "until-abort".
Behaviour = Any


class ScriptedExecutor:
    """The watchdog's view of an executor: each call behaves as scripted (async: FakeThreads
    awaits it), and records when it ran."""

    def __init__(
        self,
        *,
        tp: int = 3,
        step: Behaviour = "ok",
        abort: Behaviour = "ok",
        recreate: Behaviour = "ok",
        probe: Behaviour = "ok",
    ) -> None:
        self.tp = tp
        self.comm: Any = FakeComm() if tp > 1 else None
        self.behaviour = {"step": step, "abort": abort, "recreate": recreate, "probe": probe}
        self.aborted = trio.Event()
        self.calls: list[tuple[str, float]] = []
        self.step_started: float | None = None

    async def _act(self, name: str) -> Any:
        self.calls.append((name, trio.current_time()))
        how = self.behaviour[name]
        self.behaviour[name] = "ok"  # like a failpoint: fires once
        if name == "abort":
            return await self._abort(how)
        if how == "hang":
            await trio.sleep_forever()
        if how == "until-abort":
            await self.aborted.wait()
            raise CommAbortedError("all_reduce aborted")
        if isinstance(how, tuple):
            await trio.sleep(how[1])
        if how == "error":
            raise CommError(f"{name} failed")
        return [name]

    async def _abort(self, how: Behaviour) -> None:
        if how == "hang":
            await trio.sleep_forever()
        if isinstance(how, tuple) and how[0] == "sleep_until":
            await trio.sleep_until(how[1](self))
        elif isinstance(how, tuple):
            await trio.sleep(how[1])
        self.aborted.set()  # the abort unblocks the hung collective, even when it errors
        if how == "error":
            raise CommError("ncclCommAbort failed")

    def step(self) -> Any:  # a coroutine: FakeRunner awaits it
        self.step_started = trio.current_time()
        return self._act("step")

    def probe(self) -> Any:  # a coroutine: FakeRunner awaits it
        return self._act("probe")

    def abort_comm(self) -> Any:  # a coroutine: FakeRunner awaits it
        return self._act("abort")

    def recreate_comm(self) -> Any:  # a coroutine: FakeRunner awaits it
        return self._act("recreate")

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class FakeComm:
    def async_error(self) -> str | None:
        return "ncclRemoteError"

    def describe(self) -> dict[str, object]:
        return {"kind": "fake"}
