"""The prompts the benchmarks send.

- PROMPTS: the chat prompts of the throughput benchmarks (bench_batching, bench_http,
  bench_table's 8 streams): eight, so that a batch of 8 holds distinct ones. With TASKS they
  are also the parity set of speculation (bench_speculative.py --parity).
- TASKS: speculation's tasks (bench_speculative.py, bench_table.py's lookup rows): three
  whose answer repeats the prompt's text (rename a variable in a 60-line Python function,
  extract fields from a JSON document, answer with a quote from a given text) and a free-form
  one whose answer does not.
"""

from __future__ import annotations

import json

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some facts about the moon.",
    "Describe the water cycle.",
    "What makes a good cup of tea?",
    "Tell me about the history of Paris.",
    "How do bees make honey?",
    "Why is the sky blue?",
]


def _function() -> str:
    """A 60-line Python function (the rename task's input)."""
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
# the tasks whose answer repeats the prompt (the others are free-form)
GROUNDED = ("rename", "extract", "quote")
