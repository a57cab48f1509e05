"""The pure half of bench_table.py: what each measure is, how raw runs become a figure (the
median), how two engines' figures become a ratio, and the Markdown the README publishes.

Standard library only, no I/O: tests/test_bench_table.py checks it without a model.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENGINES = ("neuron", "llamacpp")
README_START = "<!-- bench-table:start -->"
README_END = "<!-- bench-table:end -->"


@dataclass(frozen=True)
class Measure:
    """One row kind of the table. `higher_is_better`: tokens per second (True), or a time or
    a size (False): it decides which way the advantage is computed."""

    key: str
    label: str
    unit: str
    higher_is_better: bool
    digits: int = 1


MEASURES = (
    Measure("decode_1", "decode, batch 1", "tok/s", True),
    Measure("decode_8", "decode, 8 streams (aggregate)", "tok/s", True),
    Measure("prefill_512", "prefill, 512-token prompt", "tok/s", True, 0),
    Measure("prefill_2048", "prefill, 2,048-token prompt", "tok/s", True, 0),
    Measure("ttft_cold_ms", "TTFT cold (first request of a fresh process)", "ms", False, 0),
    Measure("ready_s", "process start to ready", "s", False, 2),
    Measure("rss_mib", "RSS after load", "MiB", False, 0),
)
MEASURE_BY_KEY = {m.key: m for m in MEASURES}


def median(runs: Sequence[float]) -> float | None:
    """The median of the runs (None when there are none: a side that failed or was skipped)."""
    return statistics.median(runs) if runs else None


def advantage(measure: Measure, neuron: float | None, llamacpp: float | None) -> float | None:
    """How many times better neuron is than llama.cpp on `measure` (> 1: neuron ahead):
    neuron / llama.cpp for speeds, llama.cpp / neuron for times and sizes. None when either
    figure is missing or the divisor is not positive."""
    if neuron is None or llamacpp is None:
        return None
    top, bottom = (neuron, llamacpp) if measure.higher_is_better else (llamacpp, neuron)
    if bottom <= 0:
        return None
    return top / bottom


def fmt_number(value: float | None, digits: int) -> str:
    """`value` with `digits` decimals and thousands separators; "—" when missing."""
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def fmt_ratio(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}×"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
    """A GitHub Markdown table; `align` has one letter per column: l(eft) or r(ight)."""
    if len(align) != len(header) or any(len(r) != len(header) for r in rows):
        raise ValueError("every row and the alignment need one entry per column")
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def comparison_rows(
    models: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]],
    labels: Mapping[str, str],
) -> list[list[str]]:
    """One row per model and measure: `models[model][measure][engine]` are the raw runs.
    Cells: model, measure (unit), neuron's median, llama.cpp's, the advantage, and how many
    runs each median is of."""
    rows: list[list[str]] = []
    for model, measures in models.items():
        for measure in MEASURES:
            runs = measures.get(measure.key)
            if not runs:
                continue
            ours = median(runs.get("neuron", ()))
            peer = median(runs.get("llamacpp", ()))
            counts = "/".join(str(len(runs.get(e, ()))) for e in ENGINES)
            rows.append(
                [
                    labels.get(model, model),
                    f"{measure.label} ({measure.unit})",
                    fmt_number(ours, measure.digits),
                    fmt_number(peer, measure.digits),
                    fmt_ratio(advantage(measure, ours, peer)),
                    counts,
                ]
            )
    return rows


COMPARISON_HEADER = (
    "Model",
    "Measure",
    "neuron",
    "llama.cpp",
    "neuron's advantage",
    "runs",
)


def roofline_limit(bandwidth: float | None, bytes_per_token: float | None) -> float | None:
    """Tokens/s a decode that reads `bytes_per_token` would reach at `bandwidth` bytes/s."""
    if not bandwidth or not bytes_per_token:
        return None
    return bandwidth / bytes_per_token


def share(value: float | None, limit: float | None) -> str:
    """`value` as a percentage of `limit` ("—" when either is missing)."""
    if value is None or not limit:
        return "—"
    return f"{100 * value / limit:.0f}%"


def roofline_rows(
    models: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]],
    bytes_per_token: Mapping[str, Mapping[str, float]],
    bandwidth: float | None,
    labels: Mapping[str, str],
) -> list[list[str]]:
    """Per model and engine: MB read per decoded token, the tokens/s that `bandwidth` allows
    at that size, the batch-1 decode median, and that median as a share of the limit."""
    rows: list[list[str]] = []
    for model, measures in models.items():
        for engine, name in zip(ENGINES, ("neuron", "llama.cpp"), strict=True):
            size = bytes_per_token.get(model, {}).get(engine)
            limit = roofline_limit(bandwidth, size)
            decode = median(measures.get("decode_1", {}).get(engine, ()))
            rows.append(
                [
                    labels.get(model, model),
                    name,
                    fmt_number(None if size is None else size / 1e6, 1),
                    fmt_number(limit, 0),
                    fmt_number(decode, 1),
                    share(decode, limit),
                ]
            )
    return rows


ROOFLINE_HEADER = (
    "Model",
    "Engine",
    "MB read per token",
    "limit (tok/s)",
    "decode, batch 1 (tok/s)",
    "share of the limit",
)


def replace_section(text: str, section: str) -> str:
    """`text` (the README) with everything between the bench-table markers replaced by
    `section`. ValueError unless each marker occurs exactly once, start before end."""
    if text.count(README_START) != 1 or text.count(README_END) != 1:
        raise ValueError(f"the README needs exactly one {README_START} and one {README_END}")
    head, rest = text.split(README_START)
    if README_END not in rest:
        raise ValueError(f"{README_END} comes before {README_START}")
    _, tail = rest.split(README_END)
    return f"{head}{README_START}\n{section.strip()}\n{README_END}{tail}"


# ---- speculation rows: decode at batch 1 on one task, with and without prompt lookup ------

# the arms of a task's runs: each engine without speculation and with its prompt lookup
SPEC_ARMS = ("neuron", "neuron_lookup", "llamacpp", "llamacpp_lookup")
SPEC_HEADER = (
    "Model",
    "Task",
    "neuron",
    "neuron + lookup",
    "speed-up",
    "llama.cpp",
    "llama.cpp + lookup",
    "speed-up",
    "neuron + lookup ÷ llama.cpp + lookup",
    "share of neuron's limit (+ lookup)",
    "same greedy tokens",
)
SPEC_ALIGN = "llrrrrrrrrl"


def ratio(top: float | None, bottom: float | None) -> float | None:
    """top / bottom; None when either is missing or bottom is not positive."""
    if top is None or bottom is None or bottom <= 0:
        return None
    return top / bottom


def same_tokens(with_lookup: Sequence[int] | None, without: Sequence[int] | None) -> str:
    """Whether the greedy answers agree: "yes", "NO (from token i)", or "—" if one is missing."""
    if with_lookup is None or without is None:
        return "—"
    if list(with_lookup) == list(without):
        return "yes"
    first = next(
        (i for i, (a, b) in enumerate(zip(with_lookup, without, strict=False)) if a != b),
        min(len(with_lookup), len(without)),
    )
    return f"NO (from token {first})"


def speculation_rows(
    spec: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]],
    answers: Mapping[str, Mapping[str, Mapping[str, Sequence[int]]]],
    limits: Mapping[str, float | None],
    labels: Mapping[str, str],
) -> list[list[str]]:
    """One row per model and task: `spec[model][task][arm]` are the decode rates (tok/s) of
    the runs, `answers[model][task][arm]` an answer's tokens, `limits[model]` neuron's
    roofline limit (tok/s). Cells: each arm's median, each engine's speed-up from its
    lookup, neuron's lookup over llama.cpp's, neuron's lookup as a share of its limit, and
    whether neuron's greedy tokens are the same with the lookup as without."""
    rows: list[list[str]] = []
    for model, tasks in spec.items():
        for task, runs in tasks.items():
            m = {arm: median(runs.get(arm, ())) for arm in SPEC_ARMS}
            said = answers.get(model, {}).get(task, {})
            rows.append(
                [
                    labels.get(model, model),
                    task,
                    fmt_number(m["neuron"], 1),
                    fmt_number(m["neuron_lookup"], 1),
                    fmt_ratio(ratio(m["neuron_lookup"], m["neuron"])),
                    fmt_number(m["llamacpp"], 1),
                    fmt_number(m["llamacpp_lookup"], 1),
                    fmt_ratio(ratio(m["llamacpp_lookup"], m["llamacpp"])),
                    fmt_ratio(ratio(m["neuron_lookup"], m["llamacpp_lookup"])),
                    share(m["neuron_lookup"], limits.get(model)),
                    same_tokens(said.get("neuron_lookup"), said.get("neuron")),
                ]
            )
    return rows
