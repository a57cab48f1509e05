"""A model's warm-up: a few tiny requests through the engine before it serves, so that the
first real request pays no one-time cost the tenth does not.

What a first request would otherwise pay: the chat template's first render and the
tokenizer's first encode; the first forward of each kind (where the layers keep dense copies,
a long prefill chunk takes the dense GEMM path and its oneDNN kernels, a shorter one and the
decode rows the int kernels; padded rows of different lengths; n choices forking K/V rows);
the chat template's common start (a default system prompt), computed and then kept by the
prefix cache; the sampler's greedy fast path and its full path (penalties, top-k/top-p, a
seeded draw, logprobs); the detokeniser. `warm_up`
runs each once, through the engine's public calls only (render_chat, encode_prompt, add,
step; and the runner's dense_prefill_rows), so it follows the engine as it changes: whatever
a step does for a request, it does here first.

Every sequence ends by `max_tokens` (2) and gives its slot back; the engine is left with no
work. The steps and tokens are counted in `Engine.statistics()` like any other.

Not warmed: structured output. Its grammar engine's tokenizer (llguidance's, built from the
whole vocabulary: ~1.1 s of GIL-holding Rust for Gemma 3's 262,144 tokens, ~0.5 s for
Qwen2.5's 151,936) is built by the first constrained request, on the compile thread
(`GrammarCompiler`), not before ready: a first plain chat never needs it, and a warm-up
request that built it made every start that much longer.

Prefill rows are most of the warm-up's time (a 0.5B model computes ~80-120 rows a second on 2
cores), so a request runs no more of them than its purpose needs. Every prompt is rendered
and encoded whole; the plain chats run whole (their template's start is what a first chat
finds cached), the others only their last WARM_UP_PROMPT_TOKENS tokens (the kernels take any
number of rows alike), and the long one as many as take the dense copies, or not at all
where no layer keeps one (Qwen2.5 0.5B on an AMD EPYC 7003, no dense copies: 72 prefill
rows with the padding, down from 135; the warm-up 2.46 -> 1.54 s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.model.linear import NATIVE_DENSE_MIN_ROWS
from neuron_trio.engine.text.native_errors import panics_as_model_file_errors
from neuron_trio.engine.text.template_sandbox import TemplateLimitError
from neuron_trio.engine.types import SamplingParams
from neuron_trio.errors import ModelFileError, RequestError

WARM_UP_TOKENS = 2  # per sequence: the prefill's token, then one decode step
# Prompt tokens a request runs (its last ones), unless it says otherwise: several rows.
WARM_UP_PROMPT_TOKENS = 8
# A plain chat: the shape of the usual first request (one row, a short prefill).
_CHAT = [{"role": "user", "content": "Say hello."}]
# A chat with a system message (its prompt's last WARM_UP_PROMPT_TOKENS run).
_SYSTEM_CHAT = [
    {"role": "system", "content": "You answer in JSON."},
    {"role": "user", "content": "Give me an object."},
]
# A prompt of at least the rows where prefill leaves the int kernels for the dense copies
# (linear.py's NATIVE_DENSE_MIN_ROWS, 48; torch's int kernels: DENSE_MIN_ROWS, 16) with any
# tokenizer: a word a token at least. Its last `runner.dense_prefill_rows` tokens run.
_LONG_TEXT = " ".join(["hello"] * NATIVE_DENSE_MIN_ROWS)


@dataclass
class WarmUpReport:
    """What the warm-up ran: its requests (by what they exercise), steps and tokens."""

    requests: list[str] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0

    def __str__(self) -> str:
        return f"{', '.join(self.requests)}: {self.steps} steps, {self.tokens} tokens"


@dataclass(frozen=True)
class _Request:
    what: str
    messages: list[dict[str, str]] | None  # None: a completion of `text`
    params: SamplingParams
    text: str = ""
    rows: int | None = WARM_UP_PROMPT_TOKENS  # the prompt's last tokens that run (None: all)


def _requests(max_batch: int, dense_rows: int | None) -> list[list[_Request]]:
    """The warm-up's requests in waves; a wave's requests run together (one padded prefill,
    batched decode steps) when the slots allow, else one after the other. `dense_rows`: the
    runner's dense_prefill_rows (None: no long request)."""
    greedy = SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0.0)
    sampled = SamplingParams(
        max_tokens=WARM_UP_TOKENS,
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        min_p=0.01,
        repetition_penalty=1.1,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        seed=0,
        logprobs=True,
        top_logprobs=2,
        n=2 if max_batch >= 4 else 1,
    )
    # one row alone, greedy: the single-row decode (a request whose choices fork decodes
    # them together, and the greedy ones below run batched)
    single = _Request("single greedy", _SYSTEM_CHAT, greedy)
    sampled_chat = _Request("sampled", _CHAT, sampled, rows=None)
    greedy_chat = _Request("greedy chat", _CHAT, greedy, rows=None)
    short = _Request("short completion", None, greedy, text="Hi")
    long = _Request("long completion", None, greedy, text=_LONG_TEXT, rows=dense_rows)
    # A batch takes the sampler's greedy argmax fast path only when every row is greedy, the
    # per-row path otherwise: so the single greedy and the sampled requests run alone
    # (single-row prefill and decode), and the greedy ones together (prefill rows of different lengths, padded; a
    # batched decode), the long one alone (one row on the dense path). The sampled chat
    # computes the template's start, which the greedy chat then finds cached.
    longs = [] if dense_rows is None else [[long]]
    return [[single], [sampled_chat], *longs, [greedy_chat, short]]


def warm_up(engine: Engine) -> WarmUpReport:
    """Run the warm-up requests to completion (blocking: a worker thread, before serving).

    Raises whatever a step raises (the model cannot serve: its load fails); ModelFileError if
    the chat template exceeds its bounds or a native library panics (a file the node cannot
    serve: 422, or exit 69 for a default model, never the deadman's exit 70). The engine must
    be idle; it is idle again when this returns.
    """
    if engine.has_work:
        raise RuntimeError("warm_up needs an idle engine")
    with panics_as_model_file_errors("warm-up"):  # e.g. the tokenizer's, on a prompt
        return _warm_up(engine)


def _warm_up(engine: Engine) -> WarmUpReport:
    report = WarmUpReport()
    steps_before = engine.statistics().steps
    for wave in _requests(engine.max_batch, engine.runner.dense_prefill_rows):
        for request in wave:
            if engine.free_slots < request.params.n:
                _drain(engine, report)  # max_batch is small: one request at a time
            prompt, chat = _prompt(engine, request)
            engine.add(prompt, request.params, chat=chat)
            report.requests.append(request.what)
        _drain(engine, report)
    report.steps = engine.statistics().steps - steps_before
    return report


def _prompt(engine: Engine, request: _Request) -> tuple[list[int], bool]:
    """The request's token ids (the last `request.rows` of its prompt) and chat flag. A model
    without a (working) chat template takes the chats' text as a completion; a prompt longer
    than the context leaves room for the tokens (its start is dropped: any tokens warm up as
    well as others)."""
    text, chat = request.text, False
    if request.messages is not None:
        try:
            text, chat = engine.render_chat(request.messages), True
        except RequestError:  # no chat template: a base model serves completions only
            text = " ".join(m["content"] for m in request.messages)
        except TemplateLimitError as exc:  # the template loops or grows: the file's fault
            raise ModelFileError(f"the chat template failed the warm-up: {exc.message}") from None
    ids = engine.encode_prompt(text, chat=chat)
    room = max(1, engine.context - WARM_UP_TOKENS)
    if request.rows is not None:
        room = min(room, request.rows)
    return ids[-room:], chat


def _drain(engine: Engine, report: WarmUpReport) -> None:
    while engine.has_work:
        report.tokens += sum(len(event.token_ids) for event in engine.step())
