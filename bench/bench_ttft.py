"""Time to first token of a chat whose long system prompt was seen before, against a cold one.

    python bench/bench_ttft.py [--prefix-cache unset|true|false|both] [--rounds 5]
                               [--system-words 1450] [--dtype auto]

The real daemon (`neuron serve`, built-in model, devices = "cpu"), over HTTP/2, one request
at a time, greedy, streamed. A system prompt of about 1,500 tokens (`usage.prompt_tokens` is
printed) is sent once to prime the node; then, each round, in turn:
- warm: that same system prompt with a new user question;
- cold: a system prompt never sent before (other words from the first token on), same length.
Printed: the median time to the first content token of each and warm/cold (the goal with prefix
caching: <= 0.3). `--prefix-cache` writes `prefix_cache = true|false` into the model's entry
(`unset`: the key is left out, the daemon's default; `both`: false, then true, in one run).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import httpx
from daemon_harness import MODEL, running_daemon

VOCABULARY = (
    "the node serves models over a cluster network while operators watch metrics and logs "
    "every request carries tokens through a scheduler that batches sequences on each step "
    "memory blocks hold keys and values for attention layers until a sequence finishes "
    "routers send chats to healthy machines and retry elsewhere when a queue is full"
)
WORDS = VOCABULARY.split()
QUESTIONS = [
    "What does the node do?",
    "Who watches the metrics?",
    "What holds keys and values?",
    "Where do routers send chats?",
    "When is a request retried?",
    "What batches sequences?",
    "What happens when a sequence finishes?",
    "What do operators watch?",
]


def system_prompt(seed: int, words: int) -> str:
    """A deterministic text of `words` words; different seeds differ from the first word."""
    rng = random.Random(seed)
    head = f"Document {seed}: {rng.choice(WORDS).capitalize()}"
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"{head} {body}."


def chat(client: httpx.Client, system: str, question: str) -> tuple[float, int]:
    """(seconds to the first content token, prompt tokens) of one streamed chat."""
    doc = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    prompt_tokens = 0
    with client.stream("POST", "/v1/chat/completions", json=doc) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices")
            # the first chunk carries only the role (content ""): wait for text or the end
            if (
                first is None
                and choices
                and (choices[0]["delta"].get("content") or choices[0].get("finish_reason"))
            ):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    return (time.perf_counter() - start if first is None else first), prompt_tokens


def measure(model: dict[str, Any], rounds: int, words: int, label: str) -> float:
    with (
        running_daemon(model) as daemon,
        httpx.Client(base_url=daemon.url, http1=False, http2=True, timeout=300) as client,
    ):
        warm_system = system_prompt(0, words)
        _, tokens = chat(client, warm_system, "Say hello.")  # primes the node
        warm: list[float] = []
        cold: list[float] = []
        for r in range(rounds):
            question = QUESTIONS[r % len(QUESTIONS)]
            warm.append(chat(client, warm_system, question)[0])
            cold.append(chat(client, system_prompt(1000 + r, words), question)[0])
    w, c = statistics.median(warm), statistics.median(cold)
    verdict = "meets" if w / c <= 0.3 else "misses"
    print(
        f"{label}: prompt {tokens} tokens; TTFT warm (system prompt seen) {w * 1000:.0f} ms "
        f"[{', '.join(f'{t * 1000:.0f}' for t in warm)}], cold {c * 1000:.0f} ms "
        f"[{', '.join(f'{t * 1000:.0f}' for t in cold)}]; warm/cold {w / c:.2f} "
        f"({verdict} the 0.3 goal)"
    )
    return w / c


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--prefix-cache", choices=["unset", "true", "false", "both"], default="unset"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--system-words", type=int, default=1450, help="~1,500 tokens")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    settings: dict[str, list[bool | None]] = {
        "unset": [None],
        "true": [True],
        "false": [False],
        "both": [False, True],
    }
    for setting in settings[args.prefix_cache]:
        model: dict[str, Any] = {
            "dtype": args.dtype,
            "max_batch": args.max_batch,
            "context": args.context,
        }
        label = "prefix_cache unset (the daemon's default)"
        if setting is not None:
            model["prefix_cache"] = setting
            label = f"prefix_cache = {str(setting).lower()}"
        measure(model, args.rounds, args.system_words, label)


if __name__ == "__main__":
    main()
