"""Prompt-lookup speculation at batch 1: decode tokens/s with and without, on input-grounded
tasks (rename a variable in a 60-line function, extract fields from a JSON document, answer
with a quote) and a free-form one, alternating the two in one process on the same engine
(a loaded machine slows both alike), and whether the greedy tokens agree.

    python bench/bench_speculative.py [--model builtin|qwen|PATH] [--rounds 3]
        [--max-tokens 160] [--num-tokens 8] [--threads 2] [--streams 1]

Decode rate: the tokens after the first step's over the time from the first to the last (the
prompt's prefill is the same either way and left out), over all `--streams` copies of the
request decoded together. Ratio: the median with / without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_trio.engine.builtin import builtin_model_path
from neuron_trio.engine.engine import Engine
from neuron_trio.engine.speculative import Speculator
from neuron_trio.engine.types import SamplingParams


def _function() -> str:
    lines = ["def summarize_orders(orders, tax_rate, discounts):"]
    lines.append('    """Totals per customer, with tax and each customer\'s discount."""')
    lines.append("    totals = {}")
    for i in range(14):
        lines += [
            f"    for order in orders[{i}::14]:",
            "        customer = order['customer']",
            f"        amount = order['amount'] * (1 + tax_rate) - discounts.get(customer, {i})",
            "        totals[customer] = totals.get(customer, 0) + amount",
        ]
    lines.append("    return totals")
    return "\n".join(lines)


DOCUMENT = json.dumps(
    {
        "id": "ord-20931",
        "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "city": "London"},
        "items": [
            {"sku": "BX-114", "title": "Analytical Engine manual", "qty": 2, "price": 31.5},
            {"sku": "QT-808", "title": "Difference engine gears", "qty": 12, "price": 4.25},
        ],
        "shipping": {"method": "express", "address": "12 St James's Square, London SW1Y 4JH"},
        "notes": "Leave the parcel with the porter; call before delivery.",
    },
    indent=2,
)
TEXT = (
    "The lighthouse stood on the northern cape for two hundred years. Its keeper, Elin "
    "Marsh, climbed the one hundred and twelve steps every evening at dusk to light the lamp. "
    "In the winter of 1887 a storm tore the lantern room open, and for three nights the ships "
    "passed in darkness. Elin rebuilt the glass herself with panes carried up from the village. "
    "When the inspectors came in spring they found the light burning brighter than before."
)
TASKS = {
    "rename": "Rename the variable `totals` to `per_customer` in this function. Reply with "
    f"the whole function only.\n\n```python\n{_function()}\n```",
    "extract": "From this JSON document, return a JSON object with the customer's name, "
    f"email and city and the shipping address, copied exactly.\n\n{DOCUMENT}",
    "quote": f"{TEXT}\n\nQuote, word for word, the sentence of the text above that says what "
    "happened in the winter of 1887, then the sentence after it.",
    "free-form": "Write a short story about a robot who learns to paint.",
}


def _model(name: str) -> Path:
    if name == "builtin":
        return builtin_model_path()
    if name == "qwen":
        from bench.qwen_model import assemble

        return assemble()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--num-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--streams", type=int, default=1, help="copies decoded together")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_gguf(_model(args.model), max_batch=args.streams, context=2048)
    speculator = Speculator(args.num_tokens)
    print(
        f"model {args.model}, k = {args.num_tokens}, {args.threads} threads, {args.streams} streams"
    )
    print("| task | tokens | without tok/s | with tok/s | ratio | accepted/proposed | same |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for task in args.tasks.split(","):
        text = engine.render_chat([{"role": "user", "content": TASKS[task]}])
        prompt = engine.encode_prompt(text, chat=True)
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
